//! `sluice serve` end to end: the binary started on a free loopback port, spoken to
//! over plain HTTP/1.1. Greedy answers through each API equal `sluice run` on the same
//! prompt (the tiny fixtures here, SmolLM2 in real_serve below when it is fetched);
//! several requests at once give each the tokens it gets alone; streams carry the
//! same text as whole answers; bad requests get each API's error shape and status;
//! a client that goes away stops its sequence; a full queue answers 503.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny").join(name)
}

/// A running `sluice serve`, stopped when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0", "--threads", "2"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sluice serve starts");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = String::new();
        let addr = loop {
            let line = match lines.next() {
                Some(Ok(l)) => l,
                _ => {
                    let _ = child.kill();
                    panic!("sluice serve ended before listening: {seen}");
                }
            };
            seen += &line;
            seen.push('\n');
            if let Some(at) = line.find("listening on http://") {
                break line[at + "listening on http://".len()..].trim().to_string();
            }
        };
        // Keep reading its stderr so that it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    /// One request; returns the status, the headers (lower-case names) and the body.
    fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", self.addr);
        for (k, v) in headers {
            req += &format!("{k}: {v}\r\n");
        }
        if !body.is_empty() {
            req += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
        }
        req += "\r\n";
        s.write_all(req.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        Response::parse(&raw)
    }

    /// The server's resident memory and its peak, KiB (Linux; `None` elsewhere).
    fn memory_kib(&self) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, &[], &body.to_string())
    }

    fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], "")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn parse(raw: &[u8]) -> Response {
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a header block");
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut lines = head.lines();
        let status = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let mut body = raw[split + 4..].to_vec();
        if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked")) {
            body = dechunk(&body);
        }
        Response { status, headers, body: String::from_utf8(body).expect("a UTF-8 body") }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent event stream, with their event names.
    fn events(&self) -> Vec<(Option<String>, String)> {
        let mut out = Vec::new();
        for block in self.body.split("\n\n").filter(|b| !b.trim().is_empty()) {
            let mut name = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event:") {
                    name = Some(n.trim().to_string());
                } else if let Some(d) = line.strip_prefix("data:") {
                    data += d.trim_start();
                }
            }
            out.push((name, data));
        }
        out
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").expect("a chunk size line");
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

/// `sluice run` greedy on `prompt` at the server's default precision (fast): (what it
/// printed, without the echoed prompt or the final newline).
fn run_greedy(model: &Path, prompt: &str, chat: bool, max_tokens: usize) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(["run", "--model", model.to_str().unwrap(), "--prompt", prompt, "--threads", "2", "--precision", "fast"]);
    if chat {
        c.arg("--chat");
    }
    let n = max_tokens.to_string();
    let o = c.args(["--temperature", "0", "--max-tokens", &n]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    let out = out.strip_suffix('\n').unwrap();
    if chat { out.to_string() } else { out.strip_prefix(prompt).expect("run echoes the prompt").to_string() }
}

fn completion(server: &Server, prompt: &str, max_tokens: usize) -> Value {
    let r = server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn chat_body(question: &str, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0})
}

/// Joined `delta.content` of an OpenAI chat stream, checking its shape: the role
/// first, one finish reason, the usage chunk when asked, `[DONE]` last.
fn chat_stream_text(r: &Response, with_usage: bool) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().unwrap().1, "[DONE]", "{}", r.body);
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut finishes = 0;
    let mut usage = Value::Null;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) {
            text += ch["delta"]["content"].as_str().unwrap_or("");
            finishes += usize::from(!ch["finish_reason"].is_null());
        } else {
            usage = c["usage"].clone();
        }
    }
    assert_eq!(finishes, 1, "{}", r.body);
    assert_eq!(usage.is_null(), !with_usage, "{}", r.body);
    (text, usage)
}

#[test]
fn openai_answers_equal_sluice_run() {
    let model = fixture("qwen3");
    let server = Server::start(&model, &[]);
    assert_eq!(server.get("/health").json()["status"], "ok");
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "qwen3");

    // Completions: the generated text is what `sluice run` prints after the prompt.
    let prompt = "the quick brown fox";
    let want = run_greedy(&model, prompt, false, 12);
    let c = completion(&server, prompt, 12);
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["choices"][0]["text"], want.as_str());
    let usage = &c["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // Chat: the reply is what `sluice run --chat` prints (which starts a reply at its
    // first visible character).
    let want = run_greedy(&model, "hello there", true, 10);
    let r = server.post("/v1/chat/completions", &chat_body("hello there", 10));
    assert_eq!(r.status, 200, "{}", r.body);
    let whole = r.json();
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(content.trim_start(), want);
    assert!(["stop", "length"].contains(&whole["choices"][0]["finish_reason"].as_str().unwrap()));

    // Streamed, the same text, and the usage chunk when asked.
    let mut body = chat_body("hello there", 10);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (text, usage) = chat_stream_text(&server.post("/v1/chat/completions", &body), true);
    assert_eq!(text, content);
    assert_eq!(usage["completion_tokens"], whole["usage"]["completion_tokens"]);
    body["stream_options"] = json!({"include_usage": false});
    chat_stream_text(&server.post("/v1/chat/completions", &body), false);

    // Streamed completions, the same text.
    let r =
        server.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": true}));
    let events = r.events();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, c["choices"][0]["text"].as_str().unwrap());

    // Logprobs: the chosen token is the most likely one at temperature 0, and the
    // top list is sorted; probabilities are at most 1.
    let mut body = chat_body("hello there", 4);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let r = server.post("/v1/chat/completions", &body).json();
    let lps = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!lps.is_empty());
    for lp in lps {
        let top: Vec<f64> =
            lp["top_logprobs"].as_array().unwrap().iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert_eq!(top.len(), 3);
        assert!(top.windows(2).all(|w| w[0] >= w[1]) && top[0] <= 0.0);
        assert_eq!(lp["logprob"].as_f64().unwrap(), top[0], "{lp}");
    }

    // A stop text ends the reply before it.
    let full = c["choices"][0]["text"].as_str().unwrap();
    if let Some(cut) = full.char_indices().nth(3).map(|(i, _)| i).filter(|&i| i > 0 && i < full.len()) {
        let stop = &full[cut..];
        let stop: String = stop.chars().take(2).collect();
        let at = full.find(&stop).unwrap();
        let r = server
            .post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}));
        let r = r.json();
        assert_eq!(r["choices"][0]["text"], &full[..at]);
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
    }
}

/// A streamed response's chunks, without `[DONE]` (which it must end with).
fn stream_chunks(r: &Response) -> Vec<Value> {
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    assert_eq!(events.last().unwrap().1, "[DONE]", "{}", r.body);
    events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect()
}

/// `n` choices streamed come as they are made, each under its index, and join into the
/// texts the same request gets whole; one usage chunk counts them all. With tools
/// given, a reply that is no call streams as it comes too.
#[test]
fn several_choices_stream_and_join_into_the_whole() {
    let server = Server::start(&fixture("qwen3"), &[]);
    for chat in [false, true] {
        let (path, mut body) = if chat {
            ("/v1/chat/completions", chat_body("tell me a story", 10))
        } else {
            ("/v1/completions", json!({"prompt": "once upon a time", "max_tokens": 10}))
        };
        body["n"] = json!(3);
        body["temperature"] = json!(1.0);
        body["seed"] = json!(11);
        let whole = server.post(path, &body).json();
        let text = |c: &Value| if chat { c["message"]["content"].clone() } else { c["text"].clone() };
        let want: Vec<Value> = (0..3).map(|i| text(&whole["choices"][i])).collect();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let mut got = vec![String::new(); 3];
        let mut finishes = [0; 3];
        let mut usage = Vec::new();
        for c in stream_chunks(&server.post(path, &body)) {
            if c["choices"].as_array().unwrap().is_empty() {
                usage.push(c["usage"].clone());
            }
            for ch in c["choices"].as_array().unwrap() {
                let i = ch["index"].as_u64().unwrap() as usize;
                let piece = if chat { &ch["delta"]["content"] } else { &ch["text"] };
                got[i] += piece.as_str().unwrap_or("");
                finishes[i] += usize::from(!ch["finish_reason"].is_null());
            }
        }
        assert_eq!(got.iter().map(|t| json!(t)).collect::<Vec<_>>(), want, "{path}");
        assert_eq!(finishes, [1, 1, 1]);
        assert_eq!(usage.len(), 1);
        assert_eq!(usage[0]["completion_tokens"], whole["usage"]["completion_tokens"]);
    }
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let mut body = chat_body("tell me a story", 16);
    body["tools"] = tools;
    let whole = server.post("/v1/chat/completions", &body).json();
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    body["stream"] = json!(true);
    let pieces: Vec<String> = stream_chunks(&server.post("/v1/chat/completions", &body))
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .filter(|t| !t.is_empty())
        .collect();
    assert!(pieces.len() > 1, "the reply came in one piece: {pieces:?}");
    assert_eq!(pieces.concat().trim(), content);
}

#[test]
fn requests_together_get_what_each_gets_alone() {
    let model = fixture("qwen3-moe");
    let server = Server::start(&model, &["--parallel", "4", "--step-tokens", "8"]);
    let prompts = [
        "one two three four five six seven",
        "hello",
        "a much longer prompt, so that it is read in chunks of several steps while the others decode",
        "zz",
    ];
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| completion(&server, p, 16)["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let server = &server;
                s.spawn(move || completion(server, p, 16)["choices"][0]["text"].as_str().unwrap().to_string())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
    // Each equals `sluice run` too.
    assert_eq!(alone[2], run_greedy(&model, prompts[2], false, 16));
    let metrics = server.get("/metrics").body;
    assert!(metrics.contains("sluice_requests_completed_total 8"), "{metrics}");
    assert!(metrics.contains("sluice_time_to_first_token_seconds_count 8"), "{metrics}");
    assert!(metrics.contains("sluice_expert_cache_hit_rate") || metrics.contains("sluice_batch_size_bucket"));
}

/// On SmolLM2, whose replies end at its end-of-turn token as a chat model's do: the
/// second turn starts from the first one's kept state.
#[test]
fn a_conversation_continues_from_its_kept_state() {
    let Some(model) = smollm2() else { return };
    let ask = |server: &Server, messages: &Value| {
        let r = server.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 24, "temperature": 0}));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let server = Server::start(&model, &[]);
    let mut messages = json!([{"role": "user", "content": "What is the capital of Japan?"}]);
    let first = ask(&server, &messages);
    assert_eq!(first["choices"][0]["finish_reason"], "stop");
    let reply = first["choices"][0]["message"]["content"].clone();
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": reply}),
        json!({"role": "user", "content": "And the capital of Germany?"}),
    ]);
    let second = ask(&server, &messages);
    // The first turn's prompt and reply were not computed again.
    let held = first["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], held, "{second}");
    let answer = second["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Berlin"), "{answer}");
    // With no prompt cache nothing is kept, and the answer is the same.
    let cold = Server::start(&model, &["--prompt-cache", "0"]);
    ask(&cold, &json!([{"role": "user", "content": "What is the capital of Japan?"}]));
    let again = ask(&cold, &messages);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(again["choices"][0]["message"]["content"].as_str().unwrap().contains("Berlin"));
}

/// Two prompts that share a long beginning (a system prompt) and differ after it: the
/// second starts from a copy of the first's state at the shared part, and answers what
/// it answers with nothing kept. A sliding-window model whose ring has gone past the
/// shared part computes it again.
#[test]
fn a_shared_beginning_is_computed_once() {
    let system = "You are a careful assistant who answers in one short sentence, \
                  and you never repeat the question back to the one who asked it.";
    let ask = |server: &Server, question: &str| {
        let r = server.post(
            "/v1/completions",
            &json!({"prompt": format!("{system} {question}"), "max_tokens": 8, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let r = r.json();
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        (r["choices"][0]["text"].as_str().unwrap().to_string(), cached, r["usage"]["prompt_tokens"].as_u64().unwrap())
    };
    for (fixture_name, ring_gone_past) in [("qwen3-moe", false), ("gemma3", true)] {
        let model = fixture(fixture_name);
        let server = Server::start(&model, &[]);
        let cold = Server::start(&model, &["--prompt-cache", "0"]);
        ask(&server, "What is a river?");
        let (text, cached, prompt) = ask(&server, "Why do cats purr?");
        let (want, none, _) = ask(&cold, "Why do cats purr?");
        assert_eq!(none, 0);
        assert_eq!(text, want, "{fixture_name}");
        if ring_gone_past {
            assert_eq!(cached, 0, "{fixture_name}");
        } else {
            assert!(cached >= 16 && cached < prompt, "{fixture_name}: {cached} of {prompt} cached");
        }
        // The first conversation's state stays for its own next turn.
        let (_, again, _) = ask(&server, "What is a river?");
        assert!(ring_gone_past || again == prompt_len(&server, &format!("{system} What is a river?")) - 1);
    }
}

fn prompt_len(server: &Server, prompt: &str) -> u64 {
    completion(server, prompt, 1)["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[test]
fn anthropic_and_ollama_answers() {
    let model = fixture("qwen3");
    let server = Server::start(&model, &["--name", "tiny"]);
    let want = run_greedy(&model, "hello there", true, 10);

    let msg = json!({"model": "tiny", "max_tokens": 10, "temperature": 0,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]});
    let r = server.post("/v1/messages", &msg);
    assert_eq!(r.status, 200, "{}", r.body);
    let m = r.json();
    assert_eq!(m["type"], "message");
    assert_eq!(m["model"], "tiny");
    let text = m["content"][0]["text"].as_str().unwrap();
    assert_eq!(text.trim_start(), want);
    assert!(["end_turn", "max_tokens"].contains(&m["stop_reason"].as_str().unwrap()));
    assert!(m["usage"]["input_tokens"].as_u64().unwrap() > 0);

    let mut streamed = msg.clone();
    streamed["stream"] = json!(true);
    let r = server.post("/v1/messages", &streamed);
    let events = r.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(&names[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let joined: String = events
        .iter()
        .filter(|(n, _)| n.as_deref() == Some("content_block_delta"))
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(joined, text);

    // Ollama: NDJSON by default, the same reply; then whole.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
                      "options": {"temperature": 0, "num_predict": 10}});
    let r = server.post("/api/chat", &chat);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = r.body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert!(last["eval_count"].as_u64().unwrap() > 0 && last["prompt_eval_count"].as_u64().unwrap() > 0);
    let joined: String = lines.iter().map(|l| l["message"]["content"].as_str().unwrap().to_string()).collect();
    assert_eq!(joined, text);
    let mut whole = chat.clone();
    whole["stream"] = json!(false);
    let w = server.post("/api/chat", &whole).json();
    assert_eq!(w["message"]["content"], text);
    assert_eq!(w["done"], true);

    let g = json!({"model": "tiny", "prompt": "hello there", "stream": false, "options": {"temperature": 0, "num_predict": 10}});
    assert_eq!(server.post("/api/generate", &g).json()["response"], text);
    let tags = server.get("/api/tags").json();
    assert_eq!(tags["models"][0]["name"], "tiny");
    let show = server.post("/api/show", &json!({"model": "tiny"})).json();
    assert_eq!(show["model_info"]["general.architecture"], "qwen3");
    assert_eq!(server.post("/api/show", &json!({"model": "other"})).status, 404);
}

#[test]
fn bad_requests_get_each_apis_error() {
    let model = fixture("qwen3");
    let server = Server::start(&model, &["--max-body", "4KiB", "--api-key", "sekrit"]);
    let auth = [("Authorization", "Bearer sekrit")];
    let post = |path: &str, body: &str| server.request("POST", path, &auth, body);

    // No key, a wrong key: 401 in each API's shape; /health needs none.
    let r = server.request("POST", "/v1/chat/completions", &[], &chat_body("hi", 2).to_string());
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    let r = server.request("POST", "/v1/messages", &[("x-api-key", "wrong")], "{}");
    assert_eq!((r.status, r.json()["type"].as_str()), (401, Some("error")));
    assert_eq!(server.request("GET", "/api/tags", &[("Authorization", "Bearer sekri")], "").status, 401);
    assert_eq!(server.get("/health").status, 200);
    assert_eq!(server.request("POST", "/v1/messages", &[("x-api-key", "sekrit")], "{}").status, 400);

    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "invalid request body"),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400, "messages is empty"),
        ("/v1/chat/completions", json!({"messages": "hi"}).to_string(), 400, "invalid request body"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}).to_string(),
            400,
            "context holds 256",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).to_string(),
            400,
            "at least 1",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).to_string(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}).to_string(),
            400,
            "top_p",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stop": vec!["x"; 17]}).to_string(),
            400,
            "stop sequences",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 9, "stream": true}).to_string(),
            400,
            "n may be at most 8",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}).to_string(),
            400,
            "not one of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}})
                .to_string(),
            400,
            "json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no such type"}}}})
            .to_string(),
            400,
            "schema cannot be used",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                .to_string(),
            400,
            "image_url",
        ),
        ("/v1/chat/completions", json!({"messages": [{"role": "robot", "content": "hi"}]}).to_string(), 400, "robot"),
        ("/v1/completions", json!({"prompt": [1, 2, 99999]}).to_string(), 400, "outside the vocabulary"),
        ("/v1/completions", json!({"prompt": "hi", "model": "gpt-4o"}).to_string(), 404, "'gpt-4o' does not exist"),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": -5}).to_string(), 400, "at least 1"),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": "ten"}).to_string(), 400, "invalid request body"),
        (
            "/v1/messages",
            json!({"model": "claude", "max_tokens": 5, "messages": []}).to_string(),
            404,
            "'claude' does not exist",
        ),
        ("/api/chat", json!({"model": "llama3", "messages": []}).to_string(), 404, "'llama3' does not exist"),
        ("/v1/completions", json!({"prompt": "word ".repeat(300)}).to_string(), 400, "context holds 256"),
        ("/v1/completions", json!({"prompt": ""}).to_string(), 400, "empty"),
        ("/v1/completions", "x".repeat(5000), 413, "too large"),
        ("/v1/messages", json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(), 400, "max_tokens"),
        (
            "/v1/messages",
            json!({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}).to_string(),
            400,
            "role 'system'",
        ),
        (
            "/api/chat",
            json!({"messages": [{"role": "user", "content": "hi"}], "format": "yaml"}).to_string(),
            400,
            "format",
        ),
        ("/api/generate", json!({"prompt": 5}).to_string(), 400, "invalid request body"),
    ];
    for (path, body, status, needle) in cases {
        let r = post(path, &body);
        assert_eq!(r.status, status, "{path} {body}: {}", r.body);
        let v = r.json();
        let message = match path {
            "/v1/messages" => {
                assert_eq!(v["type"], "error");
                v["error"]["message"].as_str().unwrap().to_string()
            }
            p if p.starts_with("/api/") => v["error"].as_str().unwrap().to_string(),
            _ => {
                assert!(v["error"]["type"].is_string());
                v["error"]["message"].as_str().unwrap().to_string()
            }
        };
        assert!(message.contains(needle), "{path} {body}: {message}");
    }
    let r = server.request("GET", "/v1/nothing", &auth, "");
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (404, Some("not_found_error")));
    // After all that the server still answers.
    assert_eq!(post("/v1/chat/completions", &chat_body("hi", 2).to_string()).status, 200);
}

/// Output constrained to a JSON schema: even a random model's answer parses and
/// follows it, through OpenAI's response_format and Ollama's format; streamed the same.
#[test]
fn json_schema_output_parses_and_validates() {
    let server = Server::start(&fixture("qwen3"), &[]);
    let schema = json!({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["ok", "n", "color"],
        "additionalProperties": false,
    });
    let valid = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["ok"].is_boolean(), "{text}");
        assert!((0..=99).contains(&o["n"].as_i64().unwrap()), "{text}");
        assert!(["red", "green", "blue"].contains(&o["color"].as_str().unwrap()), "{text}");
    };
    for seed in 0..4 {
        let mut body = chat_body("describe yourself", 60);
        body["temperature"] = json!(1.0);
        body["seed"] = json!(seed);
        body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}});
        let r = server.post("/v1/chat/completions", &body).json();
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        valid(&text);
        body["stream"] = json!(true);
        let (streamed, _) = chat_stream_text(&server.post("/v1/chat/completions", &body), false);
        assert_eq!(streamed, text);
    }
    let mut body = chat_body("anything", 40);
    body["response_format"] = json!({"type": "json_object"});
    let r = server.post("/v1/chat/completions", &body).json();
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
    let ollama = json!({"messages": [{"role": "user", "content": "hi"}], "stream": false, "format": schema,
                        "options": {"num_predict": 60}});
    valid(server.post("/api/chat", &ollama).json()["message"]["content"].as_str().unwrap());
}

/// A client that sends half a body and stalls is answered 408 after the body timeout;
/// meanwhile, and after, the server answers others.
#[test]
fn a_stalled_request_times_out_and_others_go_on() {
    let server = Server::start(&fixture("qwen3"), &["--body-timeout", "1"]);
    let mut stalled = TcpStream::connect(&server.addr).unwrap();
    write!(stalled, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\"").unwrap();
    let t = Instant::now();
    assert_eq!(completion(&server, "hello", 4)["object"], "text_completion");
    let mut raw = Vec::new();
    stalled.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stalled.read_to_end(&mut raw).unwrap();
    let r = Response::parse(&raw);
    assert_eq!(r.status, 408, "{}", r.body);
    assert!(t.elapsed() >= Duration::from_millis(900), "{:?}", t.elapsed());
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("did not arrive"));
    assert_eq!(completion(&server, "hello", 4)["object"], "text_completion");
}

/// 64 clients streaming at once (8 in the batch, the rest queued): no errors, and each
/// answer is the one its request gets alone; memory is bounded by the batch and the
/// prompt cache, not by the clients: a second round of 64 leaves it where the first did.
#[test]
fn sixty_four_clients_at_once() {
    let server = Server::start(&fixture("qwen3-moe"), &["--prompt-cache", "4MiB"]);
    let idle = server.memory_kib();
    let prompt = |i: usize| format!("client {i} says hello to {}", i * 7);
    let ask = |i: usize, stream: bool| {
        let body = json!({"prompt": prompt(i), "max_tokens": 12, "temperature": 0, "stream": stream});
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        if !stream {
            return r.json()["choices"][0]["text"].as_str().unwrap().to_string();
        }
        let events = r.events();
        assert_eq!(events.last().unwrap().1, "[DONE]");
        events[..events.len() - 1]
            .iter()
            .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
            .collect::<String>()
    };
    let all_at_once = || -> Vec<String> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..64).map(|i| s.spawn(move || ask(i, true))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let together = all_at_once();
    let after_one = server.memory_kib();
    assert_eq!(all_at_once(), together);
    let after_two = server.memory_kib();
    for (i, t) in together.iter().enumerate().step_by(7) {
        assert_eq!(*t, ask(i, false), "client {i}");
    }
    if let (Some(idle), Some((rss1, peak1)), Some((rss2, peak2))) = (idle, after_one, after_two) {
        // The tiny model's 8 running states and the 4 MiB cache are a few MiB; 64
        // clients' connections and queued requests must not add more than that.
        assert!(peak1.saturating_sub(idle.0) < 48 * 1024, "peak {peak1} KiB against {} KiB idle", idle.0);
        assert!(rss2 <= rss1 + 8 * 1024 && peak2 <= peak1 + 8 * 1024, "{rss1}/{peak1} KiB then {rss2}/{peak2} KiB");
    }
    assert_eq!(metric(&server, "sluice_requests_failed_total"), 0.0);
    assert_eq!(metric(&server, "sluice_requests_rejected_total"), 0.0);
    assert_eq!(metric(&server, "sluice_running_sequences"), 0.0);
}

/// Reads a streamed response until `n` bytes of body have come, then hangs up.
fn start_stream_and_hang_up(server: &Server, body: &Value) {
    let mut s = TcpStream::connect(&server.addr).unwrap();
    let text = body.to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

fn metric(server: &Server, name: &str) -> f64 {
    let m = server.get("/metrics").body;
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} in {m}"))
        .parse()
        .unwrap()
}

/// SmolLM2 (a test that needs it fails in CI without it, and is skipped, saying so,
/// elsewhere).
fn smollm2() -> Option<PathBuf> {
    sluice_core::testing::real_model("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")
}

/// On SmolLM2, whose answers take long enough to hang up in the middle of one.
#[test]
fn a_client_that_goes_away_stops_and_a_full_queue_says_busy() {
    let Some(model) = smollm2() else { return };
    let server = Server::start(&model, &["--parallel", "1", "--max-queue", "0"]);
    // Thousands of tokens: far longer than the checks below.
    let long =
        json!({"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true});
    start_stream_and_hang_up(&server, &long);
    let t = Instant::now();
    while metric(&server, "sluice_requests_cancelled_total") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "the sequence of a client that went away was not stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(metric(&server, "sluice_running_sequences"), 0.0);
    assert_eq!(metric(&server, "sluice_requests_completed_total"), 0.0);

    // One request runs, none may wait: the next is told to come back.
    let mut held = TcpStream::connect(&server.addr).unwrap();
    let text = long.to_string();
    write!(
        held,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    let mut buf = [0u8; 256];
    let n = held.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let r = server.post("/v1/completions", &json!({"prompt": "hello", "max_tokens": 2}));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = server.post("/api/generate", &json!({"prompt": "hello", "stream": false}));
    assert_eq!((r.status, r.json()["error"].is_string()), (503, true));
    drop(held);
    // Once it is gone, the next request is served.
    let t = Instant::now();
    loop {
        let r = server.post("/v1/completions", &json!({"prompt": "hello", "max_tokens": 2}));
        if r.status == 200 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "still busy: {}", r.body);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(&server, "sluice_requests_cancelled_total"), 2.0);
}

#[test]
fn serve_flags_fail_cleanly() {
    let model = fixture("qwen3");
    let m = model.to_str().unwrap();
    for (args, needle) in [
        (vec!["--parallel", "0"], "--parallel"),
        (vec!["--prompt-cache", "lots"], "--prompt-cache"),
        (vec!["--host", "256.1.1.1"], "cannot listen"),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--model", m, "--port", "0"])
            .args(&args)
            .env_remove("SLUICE_API_KEY")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}: {err}");
        let last = err.lines().last().unwrap_or("");
        assert!(last.starts_with("error: ") && last.contains(needle), "{args:?}: {err}");
    }
}

/// SmolLM2 (the real model CI fetches): greedy answers through the server equal
/// `sluice run` on the same prompt, in chat and as a completion.
#[test]
fn real_serve_smollm2_equals_run() {
    let Some(model) = smollm2() else { return };
    let server = Server::start(&model, &[]);
    let question = "What is the capital of Japan?";
    let want = run_greedy(&model, question, true, 24);
    assert!(want.contains("Tokyo"), "{want}");
    let r = server.post("/v1/chat/completions", &chat_body(question, 24)).json();
    assert_eq!(r["choices"][0]["message"]["content"].as_str().unwrap().trim_start(), want);
    let prompt = "Once upon a time";
    assert_eq!(completion(&server, prompt, 24)["choices"][0]["text"], run_greedy(&model, prompt, false, 24).as_str());
}

/// The official `openai` and `anthropic` Python clients (scripts/client_venv.sh puts
/// them in .cache/clients; CI installs them) parse what the server says:
/// scripts/check_clients.py against SmolLM2.
#[test]
fn official_clients_talk_to_it() {
    let Some(model) = smollm2() else { return };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var_os("SLUICE_CLIENTS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cache/clients/bin/python"));
    let Some(python) = sluice_core::testing::require(python, "scripts/client_venv.sh") else { return };
    let server = Server::start(&model, &[]);
    let o = Command::new(python)
        .arg(root.join("scripts/check_clients.py"))
        .args([&format!("http://{}", server.addr), "What is the capital of Germany?", "Berlin"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

/// Qwen2.5-Coder-1.5B (scripts/fetch_models.sh qwen2.5-coder-1.5b, as CI does) calls a `get_weather` tool: the call comes back in
/// `tool_calls`, whole and streamed.
#[test]
fn real_serve_qwen_calls_a_tool() {
    let Some(model) = sluice_core::testing::real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b")
    else {
        return;
    };
    let server = Server::start(&model, &[]);
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}]);
    let mut body = json!({"messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
                          "tools": tools, "max_tokens": 60, "temperature": 0});
    let r = server.post("/v1/chat/completions", &body).json();
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["city"], "Paris");
    body["stream"] = json!(true);
    let r = server.post("/v1/chat/completions", &body);
    let calls: Vec<Value> = r
        .events()
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls").cloned())
        .collect();
    assert_eq!(calls.len(), 1, "{}", r.body);
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");
    assert_eq!(calls[0][0]["index"], 0);
}
