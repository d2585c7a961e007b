//! The two surfaces a connection speaks, binary frames and console lines: decoding input
//! into requests and encoding replies. The rest of the connection does not know which it is.

use bytes::BytesMut;
use tenure_protocol::frame::{decode_request, encode_response, split_frame, REQUEST_ID_NONE};
use tenure_protocol::limits::LINE_LEN_MAX;
use tenure_protocol::{ErrorCode, FrameError, Request, Response};

use crate::console::{self, Command};

/// One decoded unit of input, whichever surface it came from.
pub(super) enum Input {
    Request(u64, Request),
    Bad(u64, FrameError),
    Help,
    Quit,
}

/// A reason to close the connection, with an error to send first when there is one.
pub(super) struct Fatal(pub(super) Option<(ErrorCode, String)>);

/// What differs between the binary protocol and the console.
pub(super) enum Surface {
    Binary,
    Console { line_no: u64, text: String },
}

/// The refusal of a console line whose content is over [`LINE_LEN_MAX`].
fn line_too_long() -> Fatal {
    let message = format!("line longer than {LINE_LEN_MAX} bytes");
    Fatal(Some((ErrorCode::LineTooLong, message)))
}

/// Whether `buf`, which holds no `\n` yet, is already a line over [`LINE_LEN_MAX`]: more
/// content than that, not counting a final `\r` (the start of a `\r\n` still arriving).
pub(super) fn unterminated_too_long(buf: &[u8]) -> bool {
    let pending_cr = buf.last() == Some(&b'\r');
    buf.len() - usize::from(pending_cr) > LINE_LEN_MAX
}

impl Surface {
    pub(super) fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Input>, Fatal> {
        match self {
            Surface::Binary => match split_frame(buf) {
                Ok(None) => Ok(None),
                Ok(Some((_, REQUEST_ID_NONE, _))) => Ok(Some(Input::Bad(
                    REQUEST_ID_NONE,
                    FrameError::new(
                        ErrorCode::BadFrame,
                        "request id 0 is reserved for replies that answer no request".into(),
                    ),
                ))),
                Ok(Some((opcode, id, body))) => Ok(Some(match decode_request(opcode, body) {
                    Ok(request) => Input::Request(id, request),
                    Err(e) => Input::Bad(id, e),
                })),
                Err(e) => Err(Fatal(e.code().map(|code| (code, e.to_string())))),
            },
            Surface::Console { line_no, .. } => loop {
                let Some(end) = buf.iter().position(|&b| b == b'\n') else {
                    if unterminated_too_long(buf) {
                        return Err(line_too_long());
                    }
                    return Ok(None);
                };
                // The limit counts the line's content: a `\r` before the `\n` is part of the
                // terminator, as the `\n` is.
                let content_len = end - usize::from(end > 0 && buf[end - 1] == b'\r');
                if content_len > LINE_LEN_MAX {
                    return Err(line_too_long());
                }
                let line = buf.split_to(end + 1);
                let line = line.strip_suffix(b"\n").unwrap_or(&line);
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                *line_no += 1;
                let id = *line_no;
                return Ok(Some(match console::parse(line) {
                    Ok(Command::Request(request)) => Input::Request(id, request),
                    Ok(Command::Help) => Input::Help,
                    Ok(Command::Quit) => Input::Quit,
                    Ok(Command::Empty) => continue,
                    Err(e) => Input::Bad(id, e),
                }));
            },
        }
    }

    pub(super) fn encode(&mut self, id: u64, response: &Response, out: &mut BytesMut) {
        match self {
            Surface::Binary => encode_response(id, response, out),
            Surface::Console { text, .. } => {
                text.clear();
                console::format(response, text);
                out.extend_from_slice(text.as_bytes());
            }
        }
    }
}
