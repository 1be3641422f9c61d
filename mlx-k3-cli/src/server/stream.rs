//! Server-sent events from a [`Generation`]: a task turns engine events into SSE events through a
//! [`StreamFormat`] and stops (dropping the generation, which cancels it) as soon as the client is gone.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::Stream;
use tokio::sync::mpsc;

use super::generation::Generation;
use crate::engine::Event;

/// How one endpoint renders engine events.
pub trait StreamFormat: Send + 'static {
    /// SSE events for `event` (`None`: the engine dropped the request without finishing, i.e. it was
    /// cancelled); returns true when the stream is complete.
    fn on_event(&mut self, event: Option<Event>, out: &mut Vec<SseEvent>) -> bool;
}

/// The SSE response: `first` events, then the generation's events rendered by `format`.
pub fn sse(
    mut generation: Generation,
    mut format: impl StreamFormat,
    first: Vec<SseEvent>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, rx) = mpsc::channel::<SseEvent>(32);
    tokio::spawn(async move {
        for e in first {
            if tx.send(e).await.is_err() {
                return;
            }
        }
        loop {
            let event = tokio::select! {
                // The client went away: returning drops the generation, which cancels it.
                _ = tx.closed() => return,
                ev = generation.next() => ev,
            };
            let mut out = Vec::new();
            let done = format.on_event(event, &mut out);
            for e in out {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
            if done {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
}
