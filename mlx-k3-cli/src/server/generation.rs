//! One request's generation as seen from async handlers: the engine answers on a blocking std channel, so a
//! blocking relay task forwards its events to a tokio channel. Dropping the [`Generation`] (the client went
//! away, or the handler finished) sets the request's cancel flag, so the engine stops at the next token and
//! takes the next request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::error::ApiError;
use crate::engine::{EngineHandle, Event, FailureKind, Request, SubmitError};
use mlx_k3::generate::GenerationStats;

/// A submitted request: its events and its cancel flag.
pub struct Generation {
    events: mpsc::Receiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl Generation {
    /// Queues `request`; a full queue is a 503.
    pub fn submit(engine: &EngineHandle, request: Request) -> Result<Generation, ApiError> {
        let cancel = request.cancel.clone();
        let events = engine.submit(request).map_err(|e| match e {
            SubmitError::QueueFull => ApiError::unavailable(
                "the server is busy: the request queue is full; retry later".to_string(),
                "queue_full",
            ),
            SubmitError::Stopped => ApiError::unavailable("the engine has stopped", "engine_stopped"),
        })?;
        let (tx, rx) = mpsc::channel(64);
        let flag = cancel.clone();
        tokio::task::spawn_blocking(move || loop {
            // Wake up now and then to notice a receiver that went away while the request waits in the queue.
            match events.recv_timeout(Duration::from_millis(50)) {
                Ok(ev) => {
                    let last = matches!(ev, Event::Done { .. } | Event::Failed { .. });
                    if tx.blocking_send(ev).is_err() {
                        flag.store(true, Ordering::SeqCst);
                        return;
                    }
                    if last {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) if tx.is_closed() => {
                    flag.store(true, Ordering::SeqCst);
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        });
        Ok(Generation { events: rx, cancel })
    }

    /// Waits for the engine to accept the prompt: `Ok(prompt_tokens)`, or the request's error (a prompt
    /// longer than the context is a 400 with code `context_length_exceeded`).
    pub async fn started(&mut self) -> Result<usize, ApiError> {
        match self.events.recv().await {
            Some(Event::Started { prompt_tokens }) => Ok(prompt_tokens),
            Some(Event::Failed { kind, message }) => Err(failure(kind, message)),
            Some(other) => Err(ApiError::internal(format!("the engine answered {other:?} before starting"))),
            None => Err(ApiError::internal("the request was cancelled before it started")),
        }
    }

    /// The next event; `None` once the engine is done with the request.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// The flag that stops this generation.
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        // Harmless after Done; stops the engine when the client went away mid-stream.
        self.cancel.store(true, Ordering::SeqCst);
    }
}

/// The API error for an engine failure.
pub fn failure(kind: FailureKind, message: String) -> ApiError {
    match kind {
        FailureKind::BadRequest => {
            let e = ApiError::bad_request(message);
            // The engine's only length check reads "the prompt has N tokens; the model's context is M".
            if e.message.contains("the model's context is") {
                e.with_code("context_length_exceeded")
            } else {
                e
            }
        }
        FailureKind::Internal => ApiError::internal(message),
    }
}

/// OpenAI's `usage` object (with the prompt tokens served from a session cache).
pub fn usage(stats: &GenerationStats) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens - stats.prefilled_tokens},
    })
}
