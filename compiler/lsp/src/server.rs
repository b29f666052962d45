//! The main loop: the initialize handshake, then requests and notifications one at a time.
//!
//! Every request gets a response: a result, `-32602` when its params do not deserialize,
//! `-32601` for a method the server does not know, `-32600` after `shutdown`, and `-32603` if a
//! handler panics (a bug, caught so one bad request does not end the session). Documents are
//! re-checked in full on every change; a 2,000-line file takes a few milliseconds
//! (`cargo bench -p braid-lsp`), so there is no incremental analysis or debouncing.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;

use lsp_server::{Connection, ErrorCode, Message, Notification, Request, RequestId, Response};
use lsp_types::notification::Notification as _;
use lsp_types::request::Request as _;
use lsp_types::{
    CodeActionKind, CodeActionProviderCapability, CompletionOptions, HoverProviderCapability,
    InitializeResult, OneOf, PositionEncodingKind, PublishDiagnosticsParams, ServerCapabilities,
    ServerInfo, TextDocumentSyncCapability, TextDocumentSyncKind, Uri, notification, request,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::analysis::{Document, WorkspaceLoader, name_of};
use crate::{actions, completion, diagnostics, hover, navigate, position};

/// How a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// `exit` after `shutdown`: a clean end.
    Clean,
    /// `exit` without `shutdown`, or the client went away.
    Abrupt,
}

pub fn capabilities() -> ServerCapabilities {
    ServerCapabilities {
        position_encoding: Some(PositionEncodingKind::UTF16),
        text_document_sync: Some(TextDocumentSyncCapability::Kind(TextDocumentSyncKind::FULL)),
        hover_provider: Some(HoverProviderCapability::Simple(true)),
        definition_provider: Some(OneOf::Left(true)),
        references_provider: Some(OneOf::Left(true)),
        document_symbol_provider: Some(OneOf::Left(true)),
        document_formatting_provider: Some(OneOf::Left(true)),
        completion_provider: Some(CompletionOptions {
            trigger_characters: Some(vec![".".into(), ":".into()]),
            ..CompletionOptions::default()
        }),
        code_action_provider: Some(CodeActionProviderCapability::Options(
            lsp_types::CodeActionOptions {
                code_action_kinds: Some(vec![CodeActionKind::QUICKFIX]),
                ..lsp_types::CodeActionOptions::default()
            },
        )),
        ..ServerCapabilities::default()
    }
}

/// Runs a session on a connection until `exit` or until the client goes away.
pub fn serve(conn: &Connection) -> Exit {
    if !handshake(conn) {
        return Exit::Abrupt;
    }
    let mut state = State::default();
    for msg in &conn.receiver {
        match msg {
            Message::Request(req) => {
                let resp = if state.shut_down {
                    error(
                        req.id,
                        ErrorCode::InvalidRequest,
                        "the server is shut down".into(),
                    )
                } else if req.method == request::Shutdown::METHOD {
                    state.shut_down = true;
                    reply(req.id, ())
                } else {
                    let id = req.id.clone();
                    std::panic::catch_unwind(AssertUnwindSafe(|| state.request(req)))
                        .unwrap_or_else(|_| {
                            error(id, ErrorCode::InternalError, "internal error".into())
                        })
                };
                if conn.sender.send(resp.into()).is_err() {
                    return Exit::Abrupt;
                }
            }
            Message::Notification(n) if n.method == notification::Exit::METHOD => {
                return if state.shut_down {
                    Exit::Clean
                } else {
                    Exit::Abrupt
                };
            }
            Message::Notification(n) => {
                let out = std::panic::catch_unwind(AssertUnwindSafe(|| state.notification(n)))
                    .unwrap_or_default();
                for m in out {
                    if conn.sender.send(m.into()).is_err() {
                        return Exit::Abrupt;
                    }
                }
            }
            // The server sends no requests, so there are no responses to read.
            Message::Response(_) => {}
        }
    }
    Exit::Abrupt
}

/// Waits for `initialize`, answering other requests with "not initialized", and replies with
/// the capabilities. Returns false if the client leaves first.
fn handshake(conn: &Connection) -> bool {
    for msg in &conn.receiver {
        match msg {
            Message::Request(req) if req.method == request::Initialize::METHOD => {
                let resp = match serde_json::from_value::<lsp_types::InitializeParams>(req.params) {
                    Err(e) => error(req.id, ErrorCode::InvalidParams, e.to_string()),
                    Ok(_) => reply(
                        req.id,
                        InitializeResult {
                            capabilities: capabilities(),
                            server_info: Some(ServerInfo {
                                name: "braid".into(),
                                version: Some(env!("CARGO_PKG_VERSION").into()),
                            }),
                        },
                    ),
                };
                let ok = resp.response_result.is_ok();
                if conn.sender.send(resp.into()).is_err() {
                    return false;
                }
                if ok {
                    return true;
                }
            }
            Message::Request(req) => {
                let resp = error(
                    req.id,
                    ErrorCode::ServerNotInitialized,
                    "the server is not initialized".into(),
                );
                if conn.sender.send(resp.into()).is_err() {
                    return false;
                }
            }
            Message::Notification(n) if n.method == notification::Exit::METHOD => return false,
            Message::Notification(_) | Message::Response(_) => {}
        }
    }
    false
}

fn error(id: RequestId, code: ErrorCode, message: String) -> Response {
    Response::new_err(id, code as i32, message)
}

/// The open documents.
#[derive(Default)]
pub struct State {
    docs: BTreeMap<String, Document>,
    /// The text of every open document by checker name, for imports between open files.
    texts: BTreeMap<String, String>,
    shut_down: bool,
}

fn reply<R: Serialize>(id: RequestId, result: R) -> Response {
    match serde_json::to_value(result) {
        Ok(v) => Response {
            id,
            response_result: Ok(v),
        },
        Err(e) => error(id, ErrorCode::InternalError, e.to_string()),
    }
}

/// Deserializes a request's params, or makes the `-32602` response.
fn params<P: DeserializeOwned>(req: &Request) -> Result<P, Response> {
    serde_json::from_value(req.params.clone()).map_err(|e| {
        error(
            req.id.clone(),
            ErrorCode::InvalidParams,
            format!("invalid params for {}: {e}", req.method),
        )
    })
}

impl State {
    fn doc(&self, uri: &Uri) -> Option<&Document> {
        self.docs.get(uri.as_str())
    }

    fn request(&mut self, req: Request) -> Response {
        let id = req.id.clone();
        macro_rules! handle {
            ($ty:ty, |$s:ident, $p:ident| $body:expr) => {
                match params::<<$ty as lsp_types::request::Request>::Params>(&req) {
                    Err(resp) => resp,
                    Ok($p) => {
                        let $s = &*self;
                        let result: <$ty as lsp_types::request::Request>::Result = $body;
                        reply(id, result)
                    }
                }
            };
        }
        match req.method.as_str() {
            request::HoverRequest::METHOD => handle!(request::HoverRequest, |s, p| {
                let tdp = p.text_document_position_params;
                s.doc(&tdp.text_document.uri)
                    .and_then(|d| hover::hover(d, tdp.position))
            }),
            request::GotoDefinition::METHOD => handle!(request::GotoDefinition, |s, p| {
                let tdp = p.text_document_position_params;
                s.doc(&tdp.text_document.uri)
                    .and_then(|d| navigate::definition(d, tdp.position))
                    .map(lsp_types::GotoDefinitionResponse::Scalar)
            }),
            request::References::METHOD => handle!(request::References, |s, p| {
                let tdp = p.text_document_position;
                s.doc(&tdp.text_document.uri)
                    .map(|d| navigate::references(d, tdp.position, p.context.include_declaration))
            }),
            request::Completion::METHOD => handle!(request::Completion, |s, p| {
                let tdp = p.text_document_position;
                s.doc(&tdp.text_document.uri)
                    .map(|d| completion::complete(d, tdp.position).into())
            }),
            request::DocumentSymbolRequest::METHOD => {
                handle!(request::DocumentSymbolRequest, |s, p| {
                    s.doc(&p.text_document.uri)
                        .map(|d| navigate::symbols(d).into())
                })
            }
            request::Formatting::METHOD => handle!(request::Formatting, |s, p| {
                s.doc(&p.text_document.uri).map(actions::format)
            }),
            request::CodeActionRequest::METHOD => {
                handle!(request::CodeActionRequest, |s, p| {
                    s.doc(&p.text_document.uri)
                        .map(|d| actions::code_actions(d, p.range))
                })
            }
            other => error(
                id,
                ErrorCode::MethodNotFound,
                format!("unknown method {other}"),
            ),
        }
    }

    /// Handles a notification; returns the notifications to send (published diagnostics).
    fn notification(&mut self, n: Notification) -> Vec<Notification> {
        match n.method.as_str() {
            notification::DidOpenTextDocument::METHOD => {
                let Ok(p) =
                    serde_json::from_value::<lsp_types::DidOpenTextDocumentParams>(n.params)
                else {
                    return vec![];
                };
                let doc = p.text_document;
                self.update(doc.uri, doc.version, doc.text)
            }
            notification::DidChangeTextDocument::METHOD => {
                let Ok(p) =
                    serde_json::from_value::<lsp_types::DidChangeTextDocumentParams>(n.params)
                else {
                    return vec![];
                };
                let uri = p.text_document.uri;
                let Some(mut text) = self.doc(&uri).map(|d| d.text.clone()) else {
                    return vec![];
                };
                for change in p.content_changes {
                    apply_change(&mut text, change);
                }
                self.update(uri, p.text_document.version, text)
            }
            notification::DidCloseTextDocument::METHOD => {
                let Ok(p) =
                    serde_json::from_value::<lsp_types::DidCloseTextDocumentParams>(n.params)
                else {
                    return vec![];
                };
                let uri = p.text_document.uri;
                if let Some(doc) = self.docs.remove(uri.as_str()) {
                    self.texts.remove(&doc.name);
                }
                vec![publish(uri, vec![], None)]
            }
            // Unknown notifications, `initialized` and `$/…` ones need no answer.
            _ => vec![],
        }
    }

    /// Re-checks a document with new text, and the open documents that import it.
    fn update(&mut self, uri: Uri, version: i32, text: String) -> Vec<Notification> {
        let name = name_of(&uri);
        self.texts.insert(name.clone(), text.clone());
        let mut doc = self.check(uri, name.clone(), version, text);
        if let Some(old) = self.docs.remove(doc.uri.as_str()) {
            doc.inherit(old);
        }
        let mut out = self.publish_all(&doc);
        self.docs.insert(doc.uri.as_str().to_string(), doc);
        let dependents: Vec<String> = self
            .docs
            .iter()
            .filter(|(_, d)| {
                d.name != name
                    && d.checked
                        .sources
                        .files()
                        .any(|(id, f)| id != d.root() && f.name == name)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in dependents {
            if let Some(old) = self.docs.remove(&key) {
                let mut doc = self.check(
                    old.uri.clone(),
                    old.name.clone(),
                    old.version,
                    old.text.clone(),
                );
                doc.inherit(old);
                out.extend(self.publish_all(&doc));
                self.docs.insert(key, doc);
            }
        }
        out
    }

    /// The diagnostics of a check, per file: the document's own, and those of each file it
    /// imports that is not open itself (an open file publishes its own when it is checked as a
    /// root). Standard-library modules check clean and are skipped.
    fn publish_all(&self, doc: &Document) -> Vec<Notification> {
        let mut out = vec![publish(
            doc.uri.clone(),
            diagnostics::for_document(doc),
            Some(doc.version),
        )];
        for (id, file) in doc.checked.sources.files() {
            if id == doc.root()
                || file.name.starts_with("std/")
                || self.texts.contains_key(&file.name)
            {
                continue;
            }
            let Some(uri) = doc.uri_of(id) else {
                continue;
            };
            let diags = doc
                .checked
                .diagnostics
                .iter()
                .filter(|d| d.span().file == id)
                .filter_map(|d| diagnostics::to_lsp(doc, d))
                .collect();
            out.push(publish(uri, diags, None));
        }
        out
    }

    fn check(&self, uri: Uri, name: String, version: i32, text: String) -> Document {
        let loader = WorkspaceLoader { open: &self.texts };
        let checked = braid_sema::check(&name, &text, &loader);
        Document {
            uri,
            name,
            version,
            text,
            checked,
            last_parsed: None,
        }
    }
}

fn apply_change(text: &mut String, change: lsp_types::TextDocumentContentChangeEvent) {
    match change.range {
        None => *text = change.text,
        Some(range) => {
            let file = braid_diagnostics::SourceFile::new("", text.as_str());
            let start = position::position_to_offset(&file, range.start) as usize;
            let end = position::position_to_offset(&file, range.end) as usize;
            let (start, end) = (start.min(end), end.max(start));
            text.replace_range(start..end, &change.text);
        }
    }
}

fn publish(
    uri: Uri,
    diagnostics: Vec<lsp_types::Diagnostic>,
    version: Option<i32>,
) -> Notification {
    Notification::new(
        notification::PublishDiagnostics::METHOD.to_string(),
        PublishDiagnosticsParams {
            uri,
            diagnostics,
            version,
        },
    )
}
