//! `tokio_util::codec` adapters over the frame functions, one per side of a connection.
//!
//! A decoded item is itself a `Result`: a [`FrameError`] means one frame was bad but the stream
//! is still in step (answer it and go on); the codec's own error, [`ProtocolError`], means the
//! stream is lost (close the connection).

use bytes::BytesMut;
use tokio_util::codec::{Decoder, Encoder};

use crate::error::{FrameError, ProtocolError};
use crate::frame::{decode_request, decode_response, encode_request, encode_response, split_frame};
use crate::frame::{Request, Response};

/// One decoded request or the error to answer it with, tagged with its request id.
pub type RequestItem = (u64, Result<Request, FrameError>);
/// One decoded response or the reason it could not be read, tagged with its request id.
pub type ResponseItem = (u64, Result<Response, FrameError>);

/// The server's codec: decodes requests, encodes responses.
#[derive(Debug, Default, Clone, Copy)]
pub struct ServerCodec;

/// The client's codec: encodes requests, decodes responses.
#[derive(Debug, Default, Clone, Copy)]
pub struct ClientCodec;

impl Decoder for ServerCodec {
    type Item = RequestItem;
    type Error = ProtocolError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<RequestItem>, ProtocolError> {
        Ok(split_frame(src)?.map(|(opcode, id, body)| (id, decode_request(opcode, body))))
    }
}

impl Encoder<(u64, &Response)> for ServerCodec {
    type Error = ProtocolError;

    fn encode(
        &mut self,
        (id, response): (u64, &Response),
        dst: &mut BytesMut,
    ) -> Result<(), ProtocolError> {
        encode_response(id, response, dst);
        Ok(())
    }
}

impl Decoder for ClientCodec {
    type Item = ResponseItem;
    type Error = ProtocolError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<ResponseItem>, ProtocolError> {
        Ok(split_frame(src)?.map(|(opcode, id, body)| (id, decode_response(opcode, body))))
    }
}

impl Encoder<(u64, &Request)> for ClientCodec {
    type Error = ProtocolError;

    fn encode(
        &mut self,
        (id, request): (u64, &Request),
        dst: &mut BytesMut,
    ) -> Result<(), ProtocolError> {
        encode_request(id, request, dst);
        Ok(())
    }
}
