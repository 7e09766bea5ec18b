//! The HTTP side: OpenAI's endpoints over the scheduler. A handler checks the request, turns
//! it into token ids (the chat template for `/v1/chat/completions`, as `generate --chat`),
//! hands it to the scheduler, and answers with the whole response or streams it as
//! server-sent events ending in `data: [DONE]`. A client that goes away drops the handler's
//! receiver, which frees the request's slot at the scheduler's next round.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dflash_engine::Request;
use dflash_model::io::tokenizer::TextTokenizer;
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{self, ApiError, Completion, Input};
use crate::metrics::{Metrics, Outcome};
use crate::scheduler::{Event, Finished, Job};
use crate::text::TextStream;

/// What every handler shares.
pub struct AppState {
    pub model: String,
    pub tokenizer: Arc<TextTokenizer>,
    pub jobs: Mutex<Option<mpsc::Sender<Job>>>,
    pub metrics: Arc<Metrics>,
    /// Requests handed to the scheduler and not started yet.
    pub queued: Arc<AtomicUsize>,
    pub max_queue: usize,
    pub context: usize,
    /// `max_tokens` when a request names none (cut to what the context leaves).
    pub default_max_tokens: usize,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                message: "no such endpoint".into(),
                kind: "not_found_error",
                param: None,
                code: None,
            }
        })
        .with_state(state)
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": s.model, "object": "model", "created": now(), "owned_by": "dflash-rs",
        "max_model_len": s.context,
    }]}))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let body = s.metrics.render(&s.model);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    complete(s, &body, true).await
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    complete(s, &body, false).await
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

/// One accepted request: what its responses need.
struct Call {
    id: String,
    model: String,
    chat: bool,
    prompt_tokens: usize,
    c: Completion,
    tokenizer: Arc<TextTokenizer>,
}

async fn complete(s: Arc<AppState>, body: &[u8], chat: bool) -> Response {
    match start(&s, body, chat) {
        Ok((call, rx)) => match call.c.stream {
            true => stream_response(call, rx).into_response(),
            false => whole_response(call, rx).await,
        },
        Err(e) => {
            s.metrics.request(match e.status {
                StatusCode::SERVICE_UNAVAILABLE => Outcome::Shed,
                _ => Outcome::Refused,
            });
            e.into_response()
        }
    }
}

/// Check the request and hand it to the scheduler.
fn start(
    s: &AppState,
    body: &[u8],
    chat: bool,
) -> Result<(Call, UnboundedReceiver<Event>), ApiError> {
    let c = api::parse(body, chat)?;
    if let Some(m) = &c.model {
        if *m != s.model {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model '{m}' does not exist: this server serves '{}'",
                    s.model
                ),
                kind: "invalid_request_error",
                param: Some("model"),
                code: Some("model_not_found"),
            });
        }
    }
    let (param, ids) = match &c.input {
        Input::Chat(messages) => ("messages", {
            let text = s
                .tokenizer
                .apply_chat_template(messages)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            s.tokenizer.encode(&text, false)
        }),
        Input::Prompt(p) => ("prompt", s.tokenizer.encode(p, true)),
    };
    let ids = ids.map_err(|e| ApiError::invalid(param, e.to_string()))?;
    if ids.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` gives an empty prompt"),
        ));
    }
    let room = s.context.saturating_sub(ids.len());
    let too_long = |max: usize, p: &'static str| {
        ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(
            p,
            format!(
                "the prompt ({} tokens) and max_tokens ({max}) exceed the model's context of {} tokens",
                ids.len(),
                s.context
            ),
        )
    }
    };
    let max_new_tokens = match c.max_tokens {
        Some(m) if m > room => return Err(too_long(m, "max_tokens")),
        Some(m) => m,
        None if room == 0 => return Err(too_long(1, param)),
        None => s.default_max_tokens.min(room),
    };
    let tx = s.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let Some(tx) = tx else {
        return Err(unavailable("the server is shutting down"));
    };
    if s.queued.fetch_add(1, Ordering::SeqCst) >= s.max_queue {
        s.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(unavailable("the queue is full: retry later"));
    }
    let (etx, erx) = unbounded_channel();
    let req = Request {
        prompt_ids: ids.clone(),
        max_new_tokens,
        sampling: c.sampling,
        stop_ids: s.tokenizer.stop_ids.clone(),
        loop_window: 0,
    };
    let job = Job {
        req,
        events: etx,
        arrived: Instant::now(),
    };
    if tx.send(job).is_err() {
        s.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(unavailable("the server is shutting down"));
    }
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let call = Call {
        id: format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
        model: s.model.clone(),
        chat,
        prompt_tokens: ids.len(),
        c,
        tokenizer: s.tokenizer.clone(),
    };
    Ok((call, erx))
}

fn unavailable(msg: &str) -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: msg.into(),
        kind: "server_error",
        param: None,
        code: None,
    }
}

fn server_error(msg: String) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: msg,
        kind: "server_error",
        param: None,
        code: None,
    }
}

impl Call {
    fn decode(&self) -> impl Fn(&[u32]) -> anyhow::Result<String> + '_ {
        |ids| self.tokenizer.decode(ids)
    }

    fn usage(&self, completion: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
               "total_tokens": self.prompt_tokens + completion})
    }

    fn reason(&self, text: &TextStream, f: &Finished) -> &'static str {
        match text.stopped || f.by_token {
            true => "stop",
            false => "length",
        }
    }

    /// A chunk of a stream: `text` (and the role, in a chat's first chunk), or its end.
    fn chunk(&self, text: &str, first: bool, finish: Option<&str>) -> Value {
        let choice = match self.chat {
            true => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if !text.is_empty() || first {
                    delta["content"] = json!(text);
                }
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
            false => json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null}),
        };
        json!({"id": self.id, "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
               "created": now(), "model": self.model, "choices": [choice]})
    }
}

/// Wait for the whole response.
async fn whole_response(call: Call, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut text = TextStream::new(call.c.stop.clone());
    let mut out = String::new();
    let finished = loop {
        match rx.recv().await {
            Some(Event::Tokens(t)) => match text.push(&t, call.decode()) {
                Ok(s) => out += &s,
                Err(e) => return server_error(e.to_string()).into_response(),
            },
            Some(Event::Done(f)) => break f,
            Some(Event::Failed(e)) => return server_error(e).into_response(),
            None => return server_error("the scheduler stopped".into()).into_response(),
        }
        if text.stopped {
            // dropping the receiver frees the slot; the response ends at the stop string
            break Finished {
                by_token: true,
                spec: Default::default(),
            };
        }
    };
    drop(rx);
    out += &text.finish(call.decode()).unwrap_or_default();
    let reason = call.reason(&text, &finished);
    let n = text.ids().len();
    let mut choice = match call.chat {
        true => json!({"index": 0, "message": {"role": "assistant", "content": out},
                       "finish_reason": reason, "logprobs": null}),
        false => json!({"index": 0, "text": out, "finish_reason": reason, "logprobs": null}),
    };
    if call.c.return_token_ids {
        choice["token_ids"] = json!(text.ids());
    }
    Json(json!({
        "id": call.id, "object": if call.chat { "chat.completion" } else { "text_completion" },
        "created": now(), "model": call.model, "choices": [choice],
        "usage": call.usage(n), "speculative_decoding": finished.spec,
    }))
    .into_response()
}

/// Where a stream is.
enum Phase {
    Open { first: bool },
    Usage(Value),
    Done,
    Closed,
}

/// Stream the response as server-sent events.
fn stream_response(call: Call, rx: UnboundedReceiver<Event>) -> impl IntoResponse {
    let text = TextStream::new(call.c.stop.clone());
    let state = (call, rx, text, Phase::Open { first: true });
    let events = stream::unfold(state, |(call, mut rx, mut text, phase)| async move {
        let data = |v: &Value| Sse::default().data(v.to_string());
        match phase {
            Phase::Closed => None,
            Phase::Done => Some((
                Ok(Sse::default().data("[DONE]")),
                (call, rx, text, Phase::Closed),
            )),
            Phase::Usage(u) => Some((Ok(data(&u)), (call, rx, text, Phase::Done))),
            Phase::Open { first } => {
                let (ev, end) = next_event(&call, &mut rx, &mut text, first).await;
                let next = match end {
                    End::Last(usage) if call.c.include_usage => Phase::Usage(usage),
                    End::Last(_) | End::Failed => Phase::Done,
                    End::More => Phase::Open { first: false },
                };
                Some((
                    Ok::<_, std::convert::Infallible>(data(&ev)),
                    (call, rx, text, next),
                ))
            }
        }
    });
    sse(events)
}

fn sse(
    events: impl Stream<Item = Result<Sse, std::convert::Infallible>> + Send + 'static,
) -> impl IntoResponse {
    axum::response::Sse::new(events).keep_alive(KeepAlive::default())
}

/// What follows a chunk of a stream.
enum End {
    More,
    /// The response's last chunk; its usage chunk.
    Last(Value),
    /// An error body was the last chunk.
    Failed,
}

/// The next chunk of a stream, and what follows it.
async fn next_event(
    call: &Call,
    rx: &mut UnboundedReceiver<Event>,
    text: &mut TextStream,
    first: bool,
) -> (Value, End) {
    loop {
        let ev = rx.recv().await;
        let (delta, finished) = match ev {
            Some(Event::Tokens(t)) => match text.push(&t, call.decode()) {
                Ok(s) if text.stopped => (
                    s,
                    Some(Finished {
                        by_token: true,
                        spec: Default::default(),
                    }),
                ),
                Ok(s) if s.is_empty() && !first => continue,
                Ok(s) => (s, None),
                Err(e) => return (server_error(e.to_string()).body(), End::Failed),
            },
            Some(Event::Done(f)) => (text.finish(call.decode()).unwrap_or_default(), Some(f)),
            Some(Event::Failed(e)) => return (server_error(e).body(), End::Failed),
            None => {
                return (
                    server_error("the scheduler stopped".into()).body(),
                    End::Failed,
                )
            }
        };
        let Some(f) = finished else {
            return (call.chunk(&delta, first, None), End::More);
        };
        let mut last = call.chunk(&delta, first, Some(call.reason(text, &f)));
        last["speculative_decoding"] = json!(f.spec);
        let mut usage = call.chunk("", false, None);
        usage["choices"] = json!([]);
        usage["usage"] = call.usage(text.ids().len());
        return (last, End::Last(usage));
    }
}
