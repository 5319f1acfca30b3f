//! Chat templates: Jinja sources shipped with a model, rendered the way Hugging Face
//! `transformers` renders them, so that a prompt built here tokenizes to the same ids.
//!
//! transformers compiles templates in an `ImmutableSandboxedEnvironment` with
//! `trim_blocks=True, lstrip_blocks=True` and Jinja's default `keep_trailing_newline=False`,
//! adds the `loopcontrols` extension, overrides `tojson` (no HTML escaping, Python's
//! `json.dumps` spacing) and registers `raise_exception` and `strftime_now`. Everything
//! here mirrors that; the Python string, dict and list methods that templates call come
//! from minijinja-contrib's pycompat layer.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, UndefinedBehavior, Value};
use sluice_core::{Error, Result};

use crate::ChatMessage;

/// A template source and the name it is known by in error messages (the file it came
/// from, and which entry when a config holds several).
pub(crate) struct TemplateSource {
    pub name: String,
    pub text: String,
}

pub(crate) struct ChatTemplate {
    name: String,
    /// The compiled template, or why it failed to compile. A broken template must not stop
    /// a model from loading (plain prompts do not need it), so the error waits for the
    /// first render.
    env: std::result::Result<Arc<Environment<'static>>, String>,
    /// Set once a render ran past [`TEMPLATE_TIME`]: every later render fails at once
    /// (the stuck one cannot be stopped, so no second one is started).
    stuck: AtomicBool,
    /// `bos_token`, `eos_token` and the other `*_token` strings of the tokenizer config,
    /// passed to every render as HF passes `special_tokens_map`.
    tokens: Vec<(String, Value)>,
}

impl ChatTemplate {
    pub fn new(source: TemplateSource, tokens: Vec<(String, Value)>) -> Self {
        let name = source.name;
        let mut env = environment();
        let env = match env.add_template_owned(name.clone(), source.text) {
            Ok(()) => Ok(Arc::new(env)),
            Err(e) => Err(describe(&name, &e)),
        };
        ChatTemplate { name, env, tokens, stuck: AtomicBool::new(false) }
    }

    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.env.as_ref().map_err(|e| Error::Template(e.clone()))?.clone();
        if self.stuck.load(Ordering::Relaxed) {
            return Err(Error::Template(format!("{}: an earlier render did not finish; not run again", self.name)));
        }
        // Special tokens first so that the call's own variables win, as in HF where the
        // explicit keyword arguments are spread after `special_tokens_map`. HF passes
        // `tools` and `documents` as None when there are none, which templates test with
        // `is none` / `is not none`, so they must be none rather than undefined.
        let mut ctx: Vec<(String, Value)> = self.tokens.clone();
        ctx.push(("messages".into(), Value::from_serialize(messages)));
        ctx.push(("add_generation_prompt".into(), add_generation_prompt.into()));
        ctx.push(("tools".into(), tools.map_or(Value::from(()), Value::from_serialize)));
        ctx.push(("documents".into(), Value::from(())));
        let ctx: Value = ctx.into_iter().collect();
        // Fuel bounds the template's own steps, but not the work of one step: a
        // filter or a print over a lazily repeated sequence (`[] * 10**12`) iterates
        // inside minijinja without spending any. So the render runs on a thread of its
        // own and is given up after TEMPLATE_TIME.
        let name = self.name.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let render = move || {
            let template = env.get_template(&name).map_err(|e| Error::Template(describe(&name, &e)))?;
            let mut out = Bounded(Vec::new());
            template.render_captured_to(ctx, &mut out).map_err(|e| Error::Template(describe(&name, &e)))?;
            String::from_utf8(out.0).map_err(|_| Error::Template(format!("{name}: the rendered prompt is not UTF-8")))
        };
        let thread = std::thread::Builder::new()
            .name("chat-template".into())
            .spawn(move || {
                let _ = tx.send(render());
            })
            .map_err(|e| Error::Template(format!("{}: cannot start its render: {e}", self.name)))?;
        match rx.recv_timeout(TEMPLATE_TIME) {
            Ok(rendered) => {
                // The thread has sent its result and is ending: joined, so that nothing
                // of it outlives the call (found by the fuzzer's leak check).
                let _ = thread.join();
                rendered
            }
            Err(_) => {
                self.stuck.store(true, Ordering::Relaxed);
                Err(Error::Template(format!(
                    "{}: the template did not finish rendering in {} s",
                    self.name,
                    TEMPLATE_TIME.as_secs()
                )))
            }
        }
    }
}

/// A template from a model's files is code, run on every request: it gets this many
/// steps of minijinja's machine (2000 messages with a tool through each fixture's
/// template take under a million; this many run in about a second) ...
const TEMPLATE_FUEL: u64 = 20_000_000;
/// ... and this long (fuel runs out in about a second) ...
const TEMPLATE_TIME: Duration = Duration::from_secs(5);
/// ... and may write this much (a prompt longer than any context already).
const MAX_PROMPT_BYTES: usize = 64 << 20;

/// The rendered prompt, refusing to grow past [`MAX_PROMPT_BYTES`].
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_PROMPT_BYTES {
            return Err(std::io::Error::other(format!(
                "the template wrote more than {} MiB, the most a prompt may be",
                MAX_PROMPT_BYTES >> 20
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    // Jinja2's default `Undefined`: prints as empty, iterates as empty, is falsy; using an
    // attribute of it is an error. minijinja's Lenient behaves the same way.
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    // minijinja picks auto-escaping from the template name, and ours end in `.json` or
    // `.jinja`; a `.json` name would JSON-quote every `{{ }}`. Prompts are never escaped.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // Jinja2 prints Python's `str()`: `True`, `False`, `None`, where minijinja would print
    // `true`, `false`, `none`.
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::Bool if value.is_true() => out.write_str("True").map_err(Into::into),
        ValueKind::Bool => out.write_str("False").map_err(Into::into),
        ValueKind::None => out.write_str("None").map_err(Into::into),
        _ => minijinja::escape_formatter(out, state, value),
    });
    // Bounded time: a template that loops past its fuel stops with an error.
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

/// One line naming the template source, the line in it and what went wrong.
fn describe(name: &str, err: &minijinja::Error) -> String {
    let mut msg = name.to_string();
    if let Some(line) = err.line() {
        msg.push_str(&format!(" line {line}"));
    }
    msg.push_str(&format!(": {}", err.kind()));
    if let Some(detail) = err.detail() {
        msg.push_str(&format!(": {detail}"));
    }
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}

/// Templates call this to refuse a conversation they cannot format (wrong role order,
/// unsupported role); the message is the user-facing explanation.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Templates put today's date into system prompts (Llama 3.x, Gemma). HF uses local
/// time; UTC keeps the output independent of the machine's zone and needs no extra crate.
fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime_utc(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// Formats a Unix time (UTC) with the strftime codes chat templates use. Unknown codes are
/// copied through unchanged, as glibc does.
pub(crate) fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 4 with Sunday = 0).
    let weekday = (days + 4).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday_name),
            Some('a') => out.push_str(&weekday_name[..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// HF's `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`. Unlike minijinja's own filter it does not escape
/// `<`, `>`, `&` and `'`, and it spaces items the Python way (`{"a": 1, "b": 2}`), which
/// changes the tokens of every tool-calling prompt.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson: indent must be a number or a string, not {v}"),
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .filter(|p: &Vec<String>| p.len() == 2)
                .ok_or_else(|| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair of strings")
                })?;
            (parts[0].clone(), parts[1].clone())
        }
        // Python drops the trailing space of the item separator when indenting.
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOptions {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOptions {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    level: usize,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let text = serde_json::to_string(value)
                .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
            out.push_str(&text);
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), opts),
        ValueKind::Bytes => {
            let bytes = value.as_bytes().unwrap_or_default();
            write_json_str(out, &String::from_utf8_lossy(bytes), opts)
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                // JSON keys are strings; Python turns 1, True and None into "1", "true"
                // and "null".
                let name = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None | ValueKind::Undefined => "null".to_string(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
                    _ => key.to_string(),
                };
                entries.push((name, value.get_item(&key)?));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', entries.len(), opts, level, |out, i| {
                let (k, v) = &entries[i];
                write_json_str(out, k, opts);
                out.push_str(&opts.key_sep);
                write_json(out, v, opts, level + 1)
            })?;
        }
        // Sequences, tuples and anything else that iterates (a loop's range, a generator).
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), opts, level, |out, i| {
                write_json(out, &items[i], opts, level + 1)
            })?;
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {} value", value.kind()),
            ));
        }
    }
    Ok(())
}

/// Writes `open item sep item ... close`, with Python's newline-and-indent layout when an
/// indent is set (and `[]` / `{}` for empty containers either way).
fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    opts: &JsonOptions,
    level: usize,
    mut item: impl FnMut(&mut String, usize) -> std::result::Result<(), minijinja::Error>,
) -> std::result::Result<(), minijinja::Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(indent) = &opts.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    };
    for i in 0..len {
        if i > 0 {
            out.push_str(&opts.item_sep);
        }
        newline(out, level + 1);
        item(out, i)?;
    }
    newline(out, level);
    out.push(close);
    Ok(())
}

/// A JSON string as Python writes it: `"`, `\` and control characters escaped (serde_json
/// agrees byte for byte), and with `ensure_ascii` every non-ASCII character as `\uXXXX`.
fn write_json_str(out: &mut String, s: &str, opts: &JsonOptions) {
    let quoted = serde_json::to_string(s).expect("a str always serializes");
    if !opts.ensure_ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime_utc("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime_utc("%A, %B %e; %a %y %j", t), "Thursday, February 29; Thu 24 060");
        assert_eq!(strftime_utc("%I %p 100%% %Q", t), "01 PM 100% %Q");
        assert_eq!(strftime_utc("%Y-%m-%d %A", 0), "1970-01-01 Thursday");
        // Before the epoch and across a century that is not a leap year.
        assert_eq!(strftime_utc("%Y-%m-%d", -86_400), "1969-12-31");
        assert_eq!(strftime_utc("%Y-%m-%d", 4_107_542_400), "2100-03-01");
    }

    fn render(src: &str, ctx: Value) -> String {
        let mut env = environment();
        env.add_template_owned("t", src.to_string()).unwrap();
        env.get_template("t").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_matches_python() {
        let ctx = minijinja::context! { x => serde_json::json!({"b": [1, 2.5, null], "a": "<é>\n"}) };
        assert_eq!(render("{{ x|tojson }}", ctx.clone()), r#"{"a": "<é>\n", "b": [1, 2.5, null]}"#);
        assert_eq!(
            render("{{ x|tojson(ensure_ascii=true, separators=[',', ':']) }}", ctx.clone()),
            r#"{"a":"<\u00e9>\n","b":[1,2.5,null]}"#
        );
        assert_eq!(
            render("{{ x|tojson(indent=2) }}", ctx.clone()),
            "{\n  \"a\": \"<é>\\n\",\n  \"b\": [\n    1,\n    2.5,\n    null\n  ]\n}"
        );
        assert_eq!(render("{{ []|tojson(indent=2) }}{{ {}|tojson }}", ctx), "[]{}");
    }
}
