//! End-to-end tests of `braid lsp`: the real binary driven over stdio as an editor drives it,
//! with `Content-Length` framing written here, and every response snapshotted. Paths of the
//! temporary workspace and of the stdlib cache are replaced by `$WORKSPACE` and `$CACHE` so
//! that snapshots do not depend on the machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

use serde_json::{Value, json};

struct Client {
    child: Child,
    stdin: ChildStdin,
    messages: Receiver<Value>,
    pending: Vec<Value>,
    next_id: i64,
    workspace: PathBuf,
    cache: PathBuf,
}

/// A guard against a server that never answers: a hung test fails instead of hanging CI. It is
/// not a timing assertion; every answer comes in milliseconds.
const NO_ANSWER: Duration = Duration::from_secs(60);

fn read_frame(r: &mut impl BufRead) -> Option<Value> {
    let mut length = None;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some(v) = line.strip_prefix("Content-Length: ") {
            length = Some(v.parse::<usize>().unwrap());
        }
    }
    let mut body = vec![0; length?];
    r.read_exact(&mut body).ok()?;
    Some(serde_json::from_slice(&body).unwrap())
}

impl Client {
    fn start(name: &str) -> Client {
        let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("lsp-{name}"));
        let _ = std::fs::remove_dir_all(&base);
        let workspace = base.join("workspace");
        let cache = base.join("cache");
        std::fs::create_dir_all(&workspace).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_braid"))
            .arg("lsp")
            .env("XDG_CACHE_HOME", &cache)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            while let Some(v) = read_frame(&mut r) {
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Client {
            child,
            stdin,
            messages: rx,
            pending: Vec::new(),
            next_id: 1,
            workspace,
            cache,
        }
    }

    fn raw(&mut self, body: &str) {
        write!(self.stdin, "Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        self.stdin.flush().unwrap();
    }

    fn send(&mut self, v: &Value) {
        self.raw(&v.to_string());
    }

    fn recv(&mut self) -> Value {
        self.messages
            .recv_timeout(NO_ANSWER)
            .expect("the server did not answer")
    }

    fn notify(&mut self, method: &str, params: Value) {
        self.send(&json!({"jsonrpc": "2.0", "method": method, "params": params}));
    }

    /// Sends a request and returns the whole response message (result or error).
    fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        self.response(&json!(id))
    }

    fn response(&mut self, id: &Value) -> Value {
        loop {
            let msg = self.recv();
            if msg.get("method").is_none() && msg.get("id") == Some(id) {
                return msg;
            }
            self.pending.push(msg);
        }
    }

    /// The next `publishDiagnostics` notification.
    fn diagnostics(&mut self) -> Value {
        if let Some(i) = self
            .pending
            .iter()
            .position(|m| m["method"] == "textDocument/publishDiagnostics")
        {
            return self.pending.remove(i)["params"].clone();
        }
        loop {
            let msg = self.recv();
            if msg["method"] == "textDocument/publishDiagnostics" {
                return msg["params"].clone();
            }
            self.pending.push(msg);
        }
    }

    fn uri(&self, file: &str) -> String {
        format!("file://{}", self.workspace.join(file).display())
    }

    /// Pretty JSON with machine-specific paths replaced.
    fn show(&self, v: &Value) -> String {
        serde_json::to_string_pretty(v)
            .unwrap()
            .replace(&self.workspace.display().to_string(), "$WORKSPACE")
            .replace(&self.cache.display().to_string(), "$CACHE")
    }
}

/// The LSP position (UTF-16 columns) of the `nth` occurrence of `needle`, plus `delta` UTF-16
/// units.
fn pos(text: &str, needle: &str, nth: usize, delta: u32) -> Value {
    let at = text
        .match_indices(needle)
        .nth(nth)
        .unwrap_or_else(|| panic!("no {needle:?} #{nth}"))
        .0;
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[..at].matches('\n').count();
    let character = text[line_start..at].encode_utf16().count() as u32 + delta;
    json!({"line": line, "character": character})
}

fn at(uri: &str, text: &str, needle: &str, nth: usize, delta: u32) -> Value {
    json!({"textDocument": {"uri": uri}, "position": pos(text, needle, nth, delta)})
}

/// A program with a misspelt field (E0206, with a fix) and an unused `let` (W0001); the
/// comment and the regex put non-ASCII text before positions the test asks about.
const BROKEN: &str = r#"// vowels — ü and 🦀 count as letters here
use std::grpo

model policy = tiny(vocab: "bytes", layers: 2, hidden: 128, heads: 4) {
  train: adamw(lr: 3e-4)
}

dataset prompts = synthetic::letters(count: 512, seed: 7)

fn vowel_share(s: Sample) -> float {
  let unused = 1
  count(s.completion, r"[aeiouü🦀]") / max(len(s.complation), 1)
}

run grpo(policy, prompts, reward: vowel_share) {
  steps: 60, batch: 16, group: 4, max_new_tokens: 24
}
"#;

/// The same program fixed, with a layout `braid fmt` changes.
const FIXED: &str = r#"// vowels — ü and 🦀 count as letters here
use std::grpo

model policy = tiny(vocab: "bytes", layers: 2, hidden: 128, heads: 4) {
  train: adamw(lr: 3e-4)
}

dataset prompts = synthetic::letters(count: 512, seed: 7)

fn vowel_share(s: Sample) -> float {
  count(s.completion, r"[aeiouü🦀]")   /   max(len(s.completion), 1)
}

run grpo(policy, prompts, reward: vowel_share) {
  steps: 60, batch: 16, group: 4, max_new_tokens: 24
}
"#;

fn initialize(c: &mut Client) -> Value {
    let root = format!("file://{}", c.workspace.display());
    let resp = c.request(
        "initialize",
        json!({"processId": null, "rootUri": root, "capabilities": {}}),
    );
    c.notify("initialized", json!({}));
    resp
}

fn open(c: &mut Client, file: &str, text: &str) -> Value {
    std::fs::write(c.workspace.join(file), text).unwrap();
    let uri = c.uri(file);
    c.notify(
        "textDocument/didOpen",
        json!({"textDocument": {"uri": uri, "languageId": "rlhf", "version": 1, "text": text}}),
    );
    c.diagnostics()
}

#[test]
fn an_editor_session() {
    let mut c = Client::start("session");
    let init = initialize(&mut c);
    insta::assert_snapshot!("initialize", c.show(&init));
    let uri = c.uri("main.rlhf");

    let diags = open(&mut c, "main.rlhf", BROKEN);
    insta::assert_snapshot!("diagnostics_on_open", c.show(&diags));
    let codes: Vec<&str> = diags["diagnostics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, ["W0001", "E0206"]);

    let actions = c.request(
        "textDocument/codeAction",
        json!({
            "textDocument": {"uri": uri},
            "range": {"start": {"line": 0, "character": 0}, "end": {"line": 20, "character": 0}},
            "context": {"diagnostics": []}
        }),
    );
    insta::assert_snapshot!("code_actions", c.show(&actions));
    let titles: Vec<&str> = actions["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["Rename to `_unused`", "Replace with `completion`"]);
    // The fix of the misspelt field lands after the non-ASCII characters of its line.
    let fix = &actions["result"][1]["edit"]["changes"][&uri][0]["range"];
    assert_eq!(fix["start"], pos(BROKEN, "complation", 0, 0));

    c.notify(
        "textDocument/didChange",
        json!({"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"text": FIXED}]}),
    );
    let diags = c.diagnostics();
    assert_eq!(diags["version"], 2);
    assert_eq!(diags["diagnostics"], json!([]));

    let hovers = [
        ("model", at(&uri, FIXED, "policy", 1, 2)),
        ("builtin", at(&uri, FIXED, "count(", 0, 1)),
        ("std_pipeline", at(&uri, FIXED, "grpo(", 0, 1)),
        ("fn", at(&uri, FIXED, "vowel_share", 1, 3)),
        // `s.completion` after `ü` and the emoji: UTF-16 columns.
        (
            "field_after_non_ascii",
            at(&uri, FIXED, "completion)", 0, 2),
        ),
        ("division", at(&uri, FIXED, "   /   ", 0, 3)),
        ("run_setting", at(&uri, FIXED, "steps:", 0, 1)),
        ("model_option", at(&uri, FIXED, "train:", 0, 1)),
    ];
    for (name, params) in hovers {
        let resp = c.request("textDocument/hover", params);
        insta::assert_snapshot!(format!("hover_{name}"), c.show(&resp["result"]));
        if name == "field_after_non_ascii" {
            assert_eq!(
                resp["result"]["range"]["start"],
                pos(FIXED, "s.completion)", 0, 0)
            );
        }
    }

    let def = c.request(
        "textDocument/definition",
        at(&uri, FIXED, "vowel_share", 1, 0),
    );
    assert_eq!(
        def["result"]["range"]["start"],
        pos(FIXED, "vowel_share", 0, 0)
    );
    insta::assert_snapshot!("definition_fn", c.show(&def["result"]));
    let def = c.request("textDocument/definition", at(&uri, FIXED, "grpo(", 0, 0));
    insta::assert_snapshot!("definition_std", c.show(&def["result"]));
    // The stdlib module was written where the URI points, with the pipeline where it says.
    let std_uri = def["result"]["uri"].as_str().unwrap();
    let std_text = std::fs::read_to_string(std_uri.strip_prefix("file://").unwrap()).unwrap();
    let line = def["result"]["range"]["start"]["line"].as_u64().unwrap() as usize;
    assert!(
        std_text
            .lines()
            .nth(line)
            .unwrap()
            .starts_with("pipeline grpo(")
    );

    // On a `use` line: the module's file.
    let module = c.request(
        "textDocument/definition",
        at(&uri, FIXED, "use std::grpo", 0, 1),
    );
    assert_eq!(module["result"]["uri"], def["result"]["uri"]);
    assert_eq!(
        module["result"]["range"]["start"],
        json!({"line": 0, "character": 0})
    );

    let mut refs = json!(at(&uri, FIXED, "policy", 0, 0));
    refs["context"] = json!({"includeDeclaration": true});
    let refs = c.request("textDocument/references", refs);
    insta::assert_snapshot!("references_model", c.show(&refs["result"]));
    assert_eq!(refs["result"].as_array().unwrap().len(), 2);

    let labels = |resp: &Value| -> Vec<String> {
        resp["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["label"].as_str().unwrap().to_string())
            .collect()
    };
    let std_modules = c.request("textDocument/completion", at(&uri, FIXED, "grpo\n", 0, 0));
    assert_eq!(
        labels(&std_modules),
        [
            "advantages",
            "grpo",
            "kl",
            "losses",
            "ppo",
            "reinforce_pp",
            "remax",
            "rewards",
            "rloo"
        ]
    );
    let fields = c.request(
        "textDocument/completion",
        at(&uri, FIXED, "completion)", 0, 0),
    );
    insta::assert_snapshot!("completion_sample_fields", c.show(&fields["result"]));
    let model_options = c.request("textDocument/completion", at(&uri, FIXED, "train:", 0, 2));
    assert_eq!(
        labels(&model_options),
        [
            "dtype",
            "head",
            "train",
            "grad_clip",
            "max_len",
            "gradient_checkpointing"
        ]
    );
    let run_settings = c.request("textDocument/completion", at(&uri, FIXED, "steps:", 0, 0));
    insta::assert_snapshot!("completion_run_settings", labels(&run_settings).join("\n"));
    let general = c.request("textDocument/completion", at(&uri, FIXED, "count(", 0, 0));
    let general = labels(&general);
    for want in [
        "s",
        "vowel_share",
        "grpo",
        "policy",
        "prompts",
        "count",
        "generate",
        "let",
        "if",
    ] {
        assert!(
            general.iter().any(|l| l == want),
            "{want} missing from {general:?}"
        );
    }
    let builtin = c.request("textDocument/completion", at(&uri, FIXED, "count(", 0, 0));
    let count = builtin["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["label"] == "count")
        .unwrap();
    insta::assert_snapshot!("completion_builtin_item", c.show(count));

    let symbols = c.request(
        "textDocument/documentSymbol",
        json!({"textDocument": {"uri": uri}}),
    );
    insta::assert_snapshot!("document_symbols", c.show(&symbols["result"]));

    let formatting = c.request(
        "textDocument/formatting",
        json!({"textDocument": {"uri": uri}, "options": {"tabSize": 2, "insertSpaces": true}}),
    );
    insta::assert_snapshot!("formatting", c.show(&formatting["result"]));

    // A half-typed body does not parse, but completion still offers its locals.
    let half = FIXED.replace("  count(s.completion", "  let n = (\n  count(s.completion");
    c.notify(
        "textDocument/didChange",
        json!({"textDocument": {"uri": uri, "version": 3}, "contentChanges": [{"text": half}]}),
    );
    let diags = c.diagnostics();
    assert!(!diags["diagnostics"].as_array().unwrap().is_empty());
    let inside = c.request("textDocument/completion", at(&uri, &half, "= (", 0, 3));
    let inside = labels(&inside);
    assert!(inside.iter().any(|l| l == "s"), "{inside:?}");

    // A syntax error: diagnostics, and no formatting edit.
    c.notify(
        "textDocument/didChange",
        json!({"textDocument": {"uri": uri, "version": 4}, "contentChanges": [{"text": "model = (\n"}]}),
    );
    let diags = c.diagnostics();
    assert!(
        diags["diagnostics"][0]["code"]
            .as_str()
            .unwrap()
            .starts_with("E01"),
        "{diags}"
    );
    let formatting = c.request(
        "textDocument/formatting",
        json!({"textDocument": {"uri": uri}, "options": {"tabSize": 2, "insertSpaces": true}}),
    );
    assert_eq!(formatting["result"], json!([]));

    let shutdown = c.request("shutdown", Value::Null);
    assert_eq!(shutdown["result"], Value::Null);
    assert!(shutdown.get("error").is_none());
    c.notify("exit", Value::Null);
    let status = c.child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn malformed_messages_get_protocol_errors_and_the_server_keeps_going() {
    let mut c = Client::start("malformed");
    // Before initialize: requests are refused, not crashed on.
    let early = c.request("textDocument/hover", json!({}));
    assert_eq!(early["error"]["code"], -32002);
    initialize(&mut c);

    c.raw("{this is not json");
    let parse_error = c.recv();
    insta::assert_snapshot!("error_parse", c.show(&parse_error));
    assert_eq!(parse_error["error"]["code"], -32700);
    assert_eq!(parse_error["id"], Value::Null);

    c.raw(r#"{"jsonrpc":"2.0","id":41,"method":17}"#);
    let invalid = c.response(&json!(41));
    assert_eq!(invalid["error"]["code"], -32600);

    let bad_params = c.request(
        "textDocument/hover",
        json!({"textDocument": 5, "position": "here"}),
    );
    insta::assert_snapshot!("error_bad_params", c.show(&bad_params));
    assert_eq!(bad_params["error"]["code"], -32602);

    let unknown = c.request("textDocument/teleport", json!({}));
    insta::assert_snapshot!("error_unknown_method", c.show(&unknown));
    assert_eq!(unknown["error"]["code"], -32601);

    // Notifications with bad params and unknown notifications are ignored.
    c.notify("textDocument/didOpen", json!({"textDocument": "nope"}));
    c.notify("$/setTrace", json!({"value": "off"}));

    // Positions far outside the document, and a document that is not open.
    let diags = open(&mut c, "a.rlhf", "fn f(x: int) -> int { x }\n");
    assert_eq!(diags["diagnostics"], json!([]));
    let uri = c.uri("a.rlhf");
    for (line, character) in [(0, 999), (999, 0), (0, 0)] {
        let hover = c.request(
            "textDocument/hover",
            json!({"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}),
        );
        assert!(hover.get("error").is_none(), "{hover}");
    }
    let closed = c.request(
        "textDocument/definition",
        json!({"textDocument": {"uri": "file:///nowhere.rlhf"}, "position": {"line": 0, "character": 0}}),
    );
    assert_eq!(closed["result"], Value::Null);

    // Still alive: a normal request is answered.
    let hover = c.request(
        "textDocument/hover",
        at(&uri, "fn f(x: int) -> int { x }\n", "x }", 0, 0),
    );
    insta::assert_snapshot!("hover_param_in_small_file", c.show(&hover["result"]));

    // Exit without shutdown ends the server with status 1.
    c.notify("exit", Value::Null);
    let status = c.child.wait().unwrap();
    assert_eq!(status.code(), Some(1));
}

/// Reads imports from disk, like `braid check`.
struct Disk;

impl braid_sema::Loader for Disk {
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String> {
        let name = braid_sema::join(from, path);
        std::fs::read_to_string(&name)
            .map(|t| (name.clone(), t))
            .map_err(|e| e.to_string())
    }
}

/// The quick fixes the language server offers are the checker's `Diagnostic::fixes`. Applied to
/// the UI fixtures and the error gallery, each must make its diagnostic go away.
#[test]
fn every_fix_resolves_its_diagnostic() {
    let mut paths: Vec<PathBuf> = ["tests/ui", "examples/errors"]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rlhf"))
        .collect();
    paths.sort();
    let mut programs: Vec<(String, String)> = paths
        .iter()
        .map(|p| (p.display().to_string(), std::fs::read_to_string(p).unwrap()))
        .collect();
    // Misspellings the fixtures do not happen to contain.
    let run = "use std::grpo\nmodel p = tiny() { train: adamw() }\ndataset d = synthetic::letters()\nfn r(s: Sample) -> float { 1.0 }\n";
    for (i, extra) in [
        "fn f(count_me: int) -> int {\n  count_mee + 1\n}\n".to_string(),
        "fn f(s: Sample) -> string {\n  s.promt\n}\n".to_string(),
        format!("{run}run grpo(p, d, reward: r) {{ stepz: 10, steps: 10 }}\n"),
        format!(
            "{}run grpo(p, d, reward: r) {{ steps: 10 }}\n",
            run.replace("tiny()", "tinny()")
        ),
    ]
    .into_iter()
    .enumerate()
    {
        programs.push((format!("extra-{i}.rlhf"), extra));
    }
    let mut applied = std::collections::BTreeSet::new();
    for (name, text) in programs {
        let checked = braid_sema::check(&name, &text, &Disk);
        for d in &checked.diagnostics {
            for fix in &d.fixes {
                if fix.span.file != checked.program.root {
                    continue;
                }
                let (start, end) = (fix.span.start as usize, fix.span.end as usize);
                assert!(
                    start < end && end <= text.len(),
                    "{name}: {} fix span {start}..{end}",
                    d.code
                );
                let fixed = format!("{}{}{}", &text[..start], fix.replacement, &text[end..]);
                let again = braid_sema::check(&name, &fixed, &Disk);
                let still = again
                    .diagnostics
                    .iter()
                    .any(|e| e.code == d.code && e.span().start as usize == start);
                assert!(
                    !still,
                    "{name}: `{}` did not resolve {}: {}",
                    fix.title, d.code, d.message
                );
                applied.insert(d.code.as_str());
            }
        }
    }
    // The suggestions the fixtures exercise: names, fields, options, arguments, sources, types,
    // settings, and unused bindings.
    for code in [
        "E0201", "E0206", "E0207", "E0208", "E0210", "E0315", "E0405", "W0001",
    ] {
        assert!(
            applied.contains(code),
            "no fixture exercised a fix for {code}: {applied:?}"
        );
    }
}

#[test]
fn imports_come_from_open_documents_first_and_their_diagnostics_are_published() {
    let mut c = Client::start("imports");
    initialize(&mut c);
    let lib_on_disk = "fn bonus(s: Sample) -> float {\n  lenght(s.completion) * 0.1\n}\n";
    std::fs::write(c.workspace.join("lib.rlhf"), lib_on_disk).unwrap();
    let main = "use \"./lib.rlhf\"\n\nfn reward(s: Sample) -> float {\n  bonus(s) + 1.0\n}\n";
    let main_uri = c.uri("main.rlhf");
    let lib_uri = c.uri("lib.rlhf");

    // The import is read from disk; its error is published under its own URI.
    let first = open(&mut c, "main.rlhf", main);
    assert_eq!(first["uri"], main_uri.as_str());
    assert_eq!(first["diagnostics"], json!([]));
    let lib = c.diagnostics();
    assert_eq!(lib["uri"], lib_uri.as_str());
    insta::assert_snapshot!("import_diagnostics", c.show(&lib));

    // Opening the import with unsaved text: it is checked as it is in the editor.
    let lib_fixed = "fn bonus(s: Sample) -> float {\n  len(s.completion) * 0.1\n}\n";
    c.notify(
        "textDocument/didOpen",
        json!({"textDocument": {"uri": lib_uri, "languageId": "rlhf", "version": 1, "text": lib_fixed}}),
    );
    let lib = c.diagnostics();
    assert_eq!(lib["uri"], lib_uri.as_str());
    assert_eq!(lib["diagnostics"], json!([]));
    let main_again = c.diagnostics();
    assert_eq!(
        main_again["uri"],
        main_uri.as_str(),
        "the importer is re-checked"
    );
    assert_eq!(main_again["diagnostics"], json!([]));

    // Go to definition across files lands in the import.
    let def = c.request(
        "textDocument/definition",
        at(&main_uri, main, "bonus(", 0, 1),
    );
    assert_eq!(def["result"]["uri"], lib_uri.as_str());
    assert_eq!(
        def["result"]["range"]["start"],
        pos(lib_fixed, "bonus", 0, 0)
    );

    // Renaming the function in the open import breaks the importer, which is re-checked.
    let renamed = lib_fixed.replace("bonus", "extra");
    c.notify(
        "textDocument/didChange",
        json!({"textDocument": {"uri": lib_uri, "version": 2}, "contentChanges": [{"text": renamed}]}),
    );
    let lib = c.diagnostics();
    assert_eq!(lib["uri"], lib_uri.as_str());
    let main_again = c.diagnostics();
    assert_eq!(main_again["uri"], main_uri.as_str());
    assert_eq!(
        main_again["diagnostics"][0]["code"], "E0201",
        "{main_again}"
    );

    c.request("shutdown", Value::Null);
    c.notify("exit", Value::Null);
    assert!(c.child.wait().unwrap().success());
}
