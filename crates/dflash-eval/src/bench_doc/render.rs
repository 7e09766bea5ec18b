//! One record's section of docs/BENCHMARKS.md: its heading, a paragraph of provenance and
//! settings, and its rows as a table.

use super::{Json, Record};
use anyhow::{anyhow, Result};

/// Keys of the record itself that the section prints in its own words, or not at all (the
/// commits stay in the record, which the section links).
const OWN_KEYS: &[&str] = &[
    "topic",
    "title",
    "supersedes",
    "show",
    "table",
    "also",
    "columns",
    "order",
    "command",
    "date",
    "device",
    "commit",
    "binary_commit",
    "reference",
    "notes",
    "rows",
];

/// Row keys that the table leaves out: provenance the record keeps.
const HIDDEN_COLUMNS: &[&str] = &["commit", "binary_commit", "lease_call"];

/// The most rows one table prints; the record holds the rest.
pub const MAX_ROWS: usize = 7;

/// The section of `r`: `### title`, then the paragraph, then the table.
pub fn section(r: &Record) -> Result<String> {
    let mut out = format!("### {}\n", r.title);
    let mut para = vec![format!(
        "[{}](bench/{}) · {} · {}.",
        r.file,
        r.file,
        r.date,
        inline(r.text("device").unwrap_or_default())
    )];
    para.push(format!(
        "Command: {}.",
        code(r.text("command").unwrap_or_default())
    ));
    match r.text("reference") {
        Some(reference) => para.push(format!("Reference: {}.", inline(reference))),
        None => para.push("No reference.".to_string()),
    }
    if let Some(notes) = r.text("notes") {
        para.push(format!(
            "Settings: {}.",
            inline(notes).trim_end_matches('.')
        ));
    }
    let table_key = r.text("table").unwrap_or("rows");
    let rows = match r.value.get(table_key) {
        Some(v) => expand(v.as_array().unwrap_or_default()),
        None if table_key == "rows" => Vec::new(),
        None => return Err(anyhow!("{}: no table {table_key:?}", r.file)),
    };
    let shown: Vec<&Vec<(String, Json)>> = rows.iter().filter(|row| keep(r, row)).collect();
    let mut table = Table::new(&shown);
    if let Some(only) = r.value.get("columns").and_then(Json::as_array) {
        let only: Vec<&str> = only.iter().filter_map(Json::as_str).collect();
        table.columns = only
            .iter()
            .filter(|c| table.columns.iter().any(|k| k == *c))
            .map(|c| c.to_string())
            .collect();
        table.constant.retain(|(k, _)| only.contains(&k.as_str()));
    }
    if !table.constant.is_empty() {
        para.push(format!("Every row: {}.", pairs(&table.constant)));
    }
    let printed = shown.len().min(MAX_ROWS);
    if printed < rows.len() && !table.columns.is_empty() {
        para.push(format!("{printed} of the record's {} rows.", rows.len()));
    }
    for key in also(r) {
        if let Some(v) = r.value.get(&key) {
            para.push(format!("{}: {}.", label(&key), cell(v)));
        }
    }
    out.push_str(&para.join(" "));
    out.push('\n');
    out.push_str(&table.markdown());
    Ok(out)
}

/// The keys named in the record's `also`.
fn also(r: &Record) -> Vec<String> {
    let Some(items) = r.value.get("also").and_then(Json::as_array) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| i.as_str())
        .filter(|k| !OWN_KEYS.contains(k))
        .map(str::to_string)
        .collect()
}

/// The rows of a table, a row that holds a list of objects expanded into one row per object
/// (the row's other keys repeated).
fn expand(items: &[Json]) -> Vec<Vec<(String, Json)>> {
    let mut rows = Vec::new();
    for item in items {
        let Some(entries) = item.as_object() else {
            continue;
        };
        let nested = entries.iter().find(|(_, v)| v.is_table());
        match nested {
            None => rows.push(entries.to_vec()),
            Some((key, inner)) => {
                let outer: Vec<(String, Json)> =
                    entries.iter().filter(|(k, _)| k != key).cloned().collect();
                for sub in inner.as_array().unwrap_or_default() {
                    let mut row = outer.clone();
                    row.extend(sub.as_object().unwrap_or_default().iter().cloned());
                    rows.push(row);
                }
            }
        }
    }
    rows
}

/// Whether `row` passes the record's `show` filter.
fn keep(r: &Record, row: &[(String, Json)]) -> bool {
    let Some(filter) = r.value.get("show").and_then(Json::as_object) else {
        return true;
    };
    filter.iter().all(|(key, allowed)| {
        let v = row
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .unwrap_or(&Json::Null);
        allowed.as_array().is_some_and(|a| a.contains(v))
    })
}

/// The shown rows split into the columns that vary and the values every row shares.
struct Table<'a> {
    columns: Vec<String>,
    constant: Vec<(String, Json)>,
    rows: &'a [&'a Vec<(String, Json)>],
}

impl<'a> Table<'a> {
    fn new(rows: &'a [&'a Vec<(String, Json)>]) -> Table<'a> {
        let mut keys: Vec<String> = Vec::new();
        for row in rows {
            for (k, _) in row.iter() {
                if !keys.contains(k) && !HIDDEN_COLUMNS.contains(&k.as_str()) {
                    keys.push(k.clone());
                }
            }
        }
        let value = |row: &Vec<(String, Json)>, key: &str| {
            row.iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
                .unwrap_or(Json::Null)
        };
        let (mut columns, mut constant) = (Vec::new(), Vec::new());
        for key in keys {
            let first = rows.first().map(|r| value(r, &key)).unwrap_or(Json::Null);
            if rows.iter().all(|r| value(r, &key) == first) {
                constant.push((key, first));
            } else {
                columns.push(key);
            }
        }
        Table {
            columns,
            constant,
            rows,
        }
    }

    /// The table (nothing when no column varies), its first [`MAX_ROWS`] rows.
    fn markdown(&self) -> String {
        if self.columns.is_empty() {
            return String::new();
        }
        let mut out = String::from("\n|");
        for c in &self.columns {
            out.push_str(&format!(" {} |", label(c)));
        }
        out.push_str("\n|");
        out.push_str(&"---|".repeat(self.columns.len()));
        out.push('\n');
        for row in self.rows.iter().take(MAX_ROWS) {
            out.push('|');
            for c in &self.columns {
                let v = row.iter().find(|(k, _)| k == c).map(|(_, v)| v);
                out.push_str(&format!(" {} |", v.map(cell).unwrap_or_default()));
            }
            out.push('\n');
        }
        out
    }
}

/// `key value; key value`, for the values every row shares.
fn pairs(entries: &[(String, Json)]) -> String {
    entries
        .iter()
        .map(|(k, v)| format!("{} {}", label(k), cell(v)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A value as a table cell: numbers rounded for reading (the record keeps every digit).
pub fn cell(v: &Json) -> String {
    match v {
        Json::Null => "–".to_string(),
        Json::Bool(b) => if *b { "yes" } else { "no" }.to_string(),
        Json::Number(n) => number(n),
        Json::String(s) => inline(s),
        Json::Array(items) => items.iter().map(cell).collect::<Vec<_>>().join(", "),
        Json::Object(entries) => pairs(entries),
    }
}

/// A number as written, or rounded to four significant digits when it has more than three
/// decimals (integers as they are).
pub fn number(n: &serde_json::Number) -> String {
    let text = n.to_string();
    let Some(x) = n.as_f64().filter(|_| n.is_f64()) else {
        return text;
    };
    let decimals = text.split('.').nth(1).map_or(0, str::len);
    if decimals <= 3 || text.contains('e') {
        return text;
    }
    let magnitude = if x == 0.0 {
        0
    } else {
        x.abs().log10().floor() as i32
    };
    let places = (3 - magnitude).clamp(1, 8) as usize;
    let rounded = format!("{x:.places$}");
    let trimmed = rounded.trim_end_matches('0');
    trimmed.strip_suffix('.').unwrap_or(trimmed).to_string()
}

/// A key as words (`tau_pooled` → `tau pooled`); a name in capitals (a variable) as it is.
fn label(key: &str) -> String {
    if key.chars().any(|c| c.is_ascii_lowercase()) {
        key.replace('_', " ")
    } else {
        key.to_string()
    }
}

/// Text for a table cell or a paragraph: one line, and `|` that does not end a cell.
fn inline(s: &str) -> String {
    s.replace('\n', " ").replace('|', "\\|")
}

/// `s` as inline code, fenced with more backticks than it holds.
fn code(s: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in s.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    let fence = "`".repeat(longest + 1);
    let pad = if longest > 0 { " " } else { "" };
    format!("{fence}{pad}{}{pad}{fence}", s.replace('\n', " "))
}
