//! The OpenAI request bodies, read field by field so that a bad one is refused with OpenAI's
//! error body naming the field (`{"error": {"message", "type", "param", "code"}}`), and the
//! error responses.
//!
//! Example: `{"messages": [...], "temperature": -1}` → 400 with
//! `{"error": {"message": "temperature must be >= 0, got -1", "type": "invalid_request_error",
//! "param": "temperature", "code": null}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dflash_core::sampling::{SamplingField, SamplingParams};
use dflash_model::io::tokenizer::ChatMessage;
use serde_json::{json, Map, Value};

/// An error as OpenAI's API reports it.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 naming the request field at fault.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param),
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

/// What the client sent: a chat or a plain prompt.
#[derive(Debug, Clone)]
pub enum Input {
    Chat(Vec<ChatMessage>),
    Prompt(String),
}

/// A completion request, checked.
#[derive(Debug, Clone)]
pub struct Completion {
    pub model: Option<String>,
    pub input: Input,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    /// Stream a last chunk carrying `usage` (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Return the response's token ids beside its text (`return_token_ids`, as vLLM).
    pub return_token_ids: bool,
}

/// Parse and check a body of `/v1/chat/completions` (`chat`) or `/v1/completions`.
pub fn parse(body: &[u8], chat: bool) -> Result<Completion, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError {
        param: None,
        ..ApiError::invalid("body", format!("the body is not valid JSON: {e}"))
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::invalid("body", "the body must be a JSON object"));
    };
    let input = match chat {
        true => Input::Chat(messages(&o)?),
        false => Input::Prompt(prompt(&o)?),
    };
    let max_tokens = match int(&o, "max_completion_tokens")? {
        Some(n) => Some((n, "max_completion_tokens")),
        None => int(&o, "max_tokens")?.map(|n| (n, "max_tokens")),
    };
    let max_tokens = match max_tokens {
        Some((n, p)) if n <= 0 => {
            return Err(ApiError::invalid(p, format!("{p} must be >= 1, got {n}")))
        }
        Some((n, _)) => Some(n as usize),
        None => None,
    };
    if let Some(n) = int(&o, "n")? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("only n = 1 is served, got {n}"),
            ));
        }
    }
    let temperature = num(&o, "temperature")?.unwrap_or(1.0);
    let top_p = num(&o, "top_p")?.unwrap_or(1.0);
    // -1 turns top-k off, as vLLM reads it; the rule itself is the engine's
    let top_k = match int(&o, "top_k")? {
        Some(-1) | None => 0,
        Some(k) => k,
    };
    let seed = match int(&o, "seed")? {
        Some(s) => s as u64,
        None => 0,
    };
    SamplingParams::check(temperature, top_p, top_k).map_err(|(field, msg)| {
        let param = match field {
            SamplingField::Temperature => "temperature",
            SamplingField::TopP => "top_p",
            SamplingField::TopK => "top_k",
        };
        ApiError::invalid(param, msg)
    })?;
    let sampling = SamplingParams::new(temperature, top_p, top_k, seed)
        .map_err(|e| ApiError::invalid("temperature", e.to_string()))?;
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => flag(so, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options must be an object",
            ))
        }
    };
    let model = match o.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::invalid("model", "model must be a string")),
    };
    Ok(Completion {
        model,
        input,
        max_tokens,
        sampling,
        stop: stop(&o)?,
        stream: flag(&o, "stream")?.unwrap_or(false),
        include_usage,
        return_token_ids: flag(&o, "return_token_ids")?.unwrap_or(false),
    })
}

fn messages(o: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let p = "messages";
    let list = match o.get(p) {
        None | Some(Value::Null) => return Err(ApiError::invalid(p, "messages is required")),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid(p, "messages must not be empty"))
        }
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid(p, "messages must be an array")),
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(p, format!("messages[{i}].role must be a string"))
            })?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                // content parts: the text parts, joined
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|part| {
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                            _ => Err(ApiError::invalid(
                                p,
                                format!("messages[{i}].content: only text parts are served"),
                            )),
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(""),
                Some(_) => {
                    return Err(ApiError::invalid(
                        p,
                        format!("messages[{i}].content must be a string or an array of text parts"),
                    ))
                }
            };
            Ok(ChatMessage {
                role: role.to_string(),
                content,
            })
        })
        .collect()
}

fn prompt(o: &Map<String, Value>) -> Result<String, ApiError> {
    let p = "prompt";
    match o.get(p) {
        None | Some(Value::Null) => Err(ApiError::invalid(p, "prompt is required")),
        Some(Value::String(s)) if s.is_empty() => {
            Err(ApiError::invalid(p, "prompt must not be empty"))
        }
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            prompt(&Map::from_iter([(p.to_string(), a[0].clone())]))
        }
        Some(Value::Array(_)) => Err(ApiError::invalid(
            p,
            "only one prompt string per request is served",
        )),
        Some(_) => Err(ApiError::invalid(p, "prompt must be a string")),
    }
}

fn stop(o: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let p = "stop";
    let bad = || ApiError::invalid(p, "stop must be a string or an array of up to 4 strings");
    match o.get(p) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => {
            Ok(vec![s.clone()]).map(|v| v.into_iter().filter(|s| !s.is_empty()).collect())
        }
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(bad))
            .filter(|s| !matches!(s, Ok(s) if s.is_empty()))
            .collect(),
        Some(_) => Err(bad()),
    }
}

fn num(o: &Map<String, Value>, p: &'static str) -> Result<Option<f64>, ApiError> {
    match o.get(p) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(ApiError::invalid(p, format!("{p} must be a number"))),
    }
}

fn int(o: &Map<String, Value>, p: &'static str) -> Result<Option<i64>, ApiError> {
    match o.get(p) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(u)) => Ok(Some(u.min(i64::MAX as u64) as i64)),
            _ => Err(ApiError::invalid(p, format!("{p} must be an integer"))),
        },
        Some(_) => Err(ApiError::invalid(p, format!("{p} must be an integer"))),
    }
}

fn flag(o: &Map<String, Value>, p: &'static str) -> Result<Option<bool>, ApiError> {
    match o.get(p) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(p, format!("{p} must be a boolean"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str, chat: bool) -> ApiError {
        parse(body.as_bytes(), chat).unwrap_err()
    }

    #[test]
    fn every_bad_field_is_named() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (body, param) in [
            (format!("{{{m},"), "body"),
            ("[1]".to_string(), "body"),
            ("{}".to_string(), "messages"),
            (r#"{"messages":"hi"}"#.to_string(), "messages"),
            (r#"{"messages":[{"content":"hi"}]}"#.to_string(), "messages"),
            (format!(r#"{{{m},"max_tokens":0}}"#), "max_tokens"),
            (
                format!(r#"{{{m},"max_completion_tokens":-3}}"#),
                "max_completion_tokens",
            ),
            (format!(r#"{{{m},"max_tokens":"5"}}"#), "max_tokens"),
            (format!(r#"{{{m},"temperature":-0.5}}"#), "temperature"),
            (format!(r#"{{{m},"temperature":"hot"}}"#), "temperature"),
            (format!(r#"{{{m},"top_p":0}}"#), "top_p"),
            (format!(r#"{{{m},"top_p":1.5}}"#), "top_p"),
            (format!(r#"{{{m},"top_k":-2}}"#), "top_k"),
            (format!(r#"{{{m},"n":2}}"#), "n"),
            (format!(r#"{{{m},"stream":"yes"}}"#), "stream"),
            (format!(r#"{{{m},"stop":[1]}}"#), "stop"),
            (format!(r#"{{{m},"model":3}}"#), "model"),
        ] {
            let e = err(&body, true);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.unwrap_or("body"), param, "{body}: {}", e.message);
        }
        assert_eq!(err("{}", false).param, Some("prompt"));
        assert_eq!(err(r#"{"prompt":["a","b"]}"#, false).param, Some("prompt"));
    }

    #[test]
    fn a_good_request_is_read_whole() {
        let c = parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "max_tokens":7,"temperature":0,"top_p":0.9,"top_k":5,"seed":3,"stop":["\n\n"],"stream":true,
                "stream_options":{"include_usage":true}}"#,
            true,
        )
        .unwrap();
        let Input::Chat(m) = &c.input else { panic!() };
        assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("user", "ab"));
        assert_eq!(c.max_tokens, Some(7));
        assert!(c.sampling.is_greedy());
        assert_eq!((c.sampling.top_k, c.sampling.seed), (5, 3));
        assert_eq!(c.stop, vec!["\n\n".to_string()]);
        assert!(c.stream && c.include_usage && !c.return_token_ids);
        let p = parse(br#"{"prompt":["x"]}"#, false).unwrap();
        assert!(matches!(p.input, Input::Prompt(ref s) if s == "x"));
        // OpenAI's default temperature is 1
        assert_eq!(p.sampling.temperature, 1.0);
    }
}
