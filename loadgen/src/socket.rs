//! The socket side of each connection: a reader task that hands whatever arrives to
//! [`World::on_bytes`], and a writer task that writes the connection's output buffer whole,
//! one batch per wake-up. Both run on the run's one thread and share the world through an
//! `Rc<RefCell<World>>`.

use std::cell::RefCell;
use std::rc::Rc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::conn::READ_CHUNK;
use crate::world::World;

/// Reads replies for connection `index` until the stream ends or breaks. `half` is a TCP
/// socket's owned read half (no lock shared with the writer) or a TLS stream's split half.
pub async fn reader<R: AsyncRead + Unpin>(world: Rc<RefCell<World>>, index: usize, mut half: R) {
    let mut input = BytesMut::with_capacity(READ_CHUNK);
    loop {
        if input.capacity() - input.len() < READ_CHUNK / 4 {
            input.reserve(READ_CHUNK);
        }
        let why = match half.read_buf(&mut input).await {
            Ok(0) => "the server closed the connection".to_owned(),
            Err(e) => format!("read failed: {e}"),
            Ok(_) => match world.borrow_mut().on_bytes(index, &mut input) {
                Ok(()) => continue,
                Err(e) => format!("bad reply stream: {e:#}"),
            },
        };
        world.borrow_mut().conns[index].failed = Some(why);
        return;
    }
}

/// Writes whatever the scenario encoded for connection `index`, one batch per wake-up.
pub async fn writer<W: AsyncWrite + Unpin>(world: Rc<RefCell<World>>, index: usize, mut half: W) {
    let notify = world.borrow().conns[index].notify.clone();
    let mut spare = BytesMut::with_capacity(READ_CHUNK);
    loop {
        notify.notified().await;
        std::mem::swap(&mut spare, &mut world.borrow_mut().conns[index].out);
        if spare.is_empty() {
            continue;
        }
        // TLS may keep the tail of a batch in its buffer until flushed; TCP's flush does nothing.
        let written = match half.write_all(&spare).await {
            Ok(()) => half.flush().await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            world.borrow_mut().conns[index].failed = Some(format!("write failed: {e}"));
            return;
        }
        spare.clear();
    }
}
