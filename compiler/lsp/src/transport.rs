//! The stdio transport: `Content-Length` framing of JSON-RPC messages on stdin and stdout.
//!
//! lsp-server ships a stdio transport, but its reader thread stops at the first malformed
//! message, which would end the session over one bad frame. This one answers a frame that is
//! not JSON with a `-32700` parse error and a JSON value that is not a JSON-RPC message with a
//! `-32600` invalid-request error, and keeps reading. Everything valid is handed to the server
//! as an [`lsp_server::Message`] through the same channels as lsp-server's own transports.

use std::io::{self, BufRead, Write};
use std::thread;

use lsp_server::{Connection, ErrorCode, Message};

/// The reader and writer threads of a stdio connection.
pub struct IoThreads {
    reader: thread::JoinHandle<()>,
    writer: thread::JoinHandle<io::Result<()>>,
}

impl IoThreads {
    /// Waits for both threads: the reader ends at end of input or after `exit`, the writer when
    /// the server drops its sender.
    pub fn join(self) -> io::Result<()> {
        let reader = self.reader.join();
        let writer = self.writer.join();
        if reader.is_err() {
            return Err(io::Error::other("the LSP reader thread panicked"));
        }
        writer.unwrap_or_else(|_| Err(io::Error::other("the LSP writer thread panicked")))
    }
}

/// A connection over this process's stdin and stdout.
pub fn stdio() -> io::Result<(Connection, IoThreads)> {
    let (to_server, server_in) = crossbeam_channel::unbounded::<Message>();
    let (server_out, from_server) = crossbeam_channel::unbounded::<Message>();
    let writer = thread::Builder::new()
        .name("braid-lsp-writer".into())
        .spawn(move || {
            for msg in from_server {
                // One lock per message, so the reader's error replies never interleave.
                let mut out = io::stdout().lock();
                msg.write(&mut out)?;
            }
            Ok(())
        })?;
    let reader = thread::Builder::new()
        .name("braid-lsp-reader".into())
        .spawn(move || {
            let stdin = io::stdin();
            let mut input = stdin.lock();
            read_loop(&mut input, &to_server, &mut || io::stdout().lock());
        })?;
    Ok((
        Connection {
            sender: server_out,
            receiver: server_in,
        },
        IoThreads { reader, writer },
    ))
}

/// Reads frames until end of input or an `exit` notification, forwarding valid messages and
/// answering invalid ones on `out`.
pub fn read_loop<W: Write>(
    input: &mut impl BufRead,
    to_server: &crossbeam_channel::Sender<Message>,
    out: &mut impl FnMut() -> W,
) {
    loop {
        let body = match read_frame(input) {
            Frame::End => return,
            Frame::Bad(why) => {
                reply_error(
                    &mut out(),
                    serde_json::Value::Null,
                    ErrorCode::ParseError,
                    &why,
                );
                continue;
            }
            Frame::Body(body) => body,
        };
        let value: serde_json::Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                let why = format!("the message is not JSON: {e}");
                reply_error(
                    &mut out(),
                    serde_json::Value::Null,
                    ErrorCode::ParseError,
                    &why,
                );
                continue;
            }
        };
        let id = value.get("id").cloned().unwrap_or(serde_json::Value::Null);
        let msg: Message = match serde_json::from_value(value) {
            Ok(m) => m,
            Err(e) => {
                let why = format!("not a JSON-RPC request, response or notification: {e}");
                reply_error(&mut out(), id, ErrorCode::InvalidRequest, &why);
                continue;
            }
        };
        let exit = matches!(&msg, Message::Notification(n) if n.method == "exit");
        if to_server.send(msg).is_err() || exit {
            return;
        }
    }
}

enum Frame {
    Body(Vec<u8>),
    /// A frame whose header could not be read; the next frame may still be fine.
    Bad(String),
    End,
}

fn read_frame(input: &mut impl BufRead) -> Frame {
    let mut length: Option<Result<usize, String>> = None;
    let mut saw_header = false;
    loop {
        let mut line = String::new();
        match input.read_line(&mut line) {
            Ok(0) => return Frame::End,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return Frame::Bad(format!("a header is not UTF-8: {e}"));
            }
            Err(_) => return Frame::End,
        }
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            if !saw_header {
                // Blank lines between frames are tolerated.
                continue;
            }
            break;
        }
        saw_header = true;
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = Some(
                value
                    .trim()
                    .parse::<usize>()
                    .map_err(|e| format!("bad Content-Length `{}`: {e}", value.trim())),
            );
        }
    }
    let length = match length {
        None => return Frame::Bad("a frame without a Content-Length header".into()),
        Some(Err(why)) => return Frame::Bad(why),
        Some(Ok(n)) => n,
    };
    let mut body = vec![0; length];
    match input.read_exact(&mut body) {
        Ok(()) => Frame::Body(body),
        Err(_) => Frame::End,
    }
}

fn reply_error(out: &mut impl Write, id: serde_json::Value, code: ErrorCode, message: &str) {
    let reply = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": { "code": code as i32, "message": message },
    });
    let text = reply.to_string();
    // A client that has gone away cannot be told anything; the reader ends at end of input.
    let _ = write!(out, "Content-Length: {}\r\n\r\n{text}", text.len());
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(body: &str) -> String {
        format!("Content-Length: {}\r\n\r\n{body}", body.len())
    }

    #[test]
    fn bad_frames_get_errors_and_reading_goes_on() {
        let input = [
            frame("{not json"),
            "Content-Type: x\r\n\r\n".to_string(),
            frame(r#"{"jsonrpc":"2.0","id":7,"method":12}"#),
            frame(r#"{"jsonrpc":"2.0","method":"initialized","params":{}}"#),
            frame(r#"{"jsonrpc":"2.0","method":"exit"}"#),
            frame(r#"{"jsonrpc":"2.0","method":"never-read"}"#),
        ]
        .concat();
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut replies: Vec<u8> = Vec::new();
        let mut cursor = io::Cursor::new(input.into_bytes());
        {
            let sink = std::cell::RefCell::new(&mut replies);
            read_loop(&mut cursor, &tx, &mut || Sink(&sink));
        }
        let replies = String::from_utf8(replies).unwrap();
        assert!(replies.contains(r#""code":-32700"#), "{replies}");
        assert!(replies.contains("without a Content-Length"), "{replies}");
        assert!(
            replies.contains(r#""code":-32600"#) && replies.contains(r#""id":7"#),
            "{replies}"
        );
        let methods: Vec<String> = rx
            .try_iter()
            .map(|m| match m {
                Message::Notification(n) => n.method,
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(methods, ["initialized", "exit"]);
    }

    struct Sink<'a, 'b>(&'a std::cell::RefCell<&'b mut Vec<u8>>);

    impl Write for Sink<'_, '_> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.borrow_mut().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
}
