//! dflash-serve: an OpenAI-compatible HTTP server over the decoding engine (`dflash-rs serve`).
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (whole, or streamed as
//! server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus text under vLLM's names). One thread decodes
//! ([`scheduler`]); the HTTP side runs on tokio + axum ([`routes`]). Bad requests get OpenAI's
//! error body naming the field ([`api`]); more requests than the slots wait in a bounded queue,
//! beyond it 503 with `Retry-After`. SIGTERM or Ctrl-C stops accepting, finishes what is in
//! flight and returns.

pub mod api;
pub mod metrics;
pub mod routes;
pub mod running;
pub mod scheduler;
pub mod text;

use std::net::TcpListener;
use std::sync::atomic::AtomicUsize;
use std::sync::{mpsc, Arc, Mutex};

use anyhow::{Context, Result};
use dflash_model::io::tokenizer::TextTokenizer;

pub use scheduler::Engine;

/// How the server answers.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The name `/v1/models` lists and requests must name (or omit).
    pub model: String,
    /// Requests waiting for a slot beyond which new ones get a 503.
    pub max_queue: usize,
    /// `max_tokens` of a request that names none (cut to what the context leaves).
    pub default_max_tokens: usize,
}

/// Serve on `listener` until SIGTERM or Ctrl-C; every request in flight then finishes. Prints
/// `listening on http://ADDR` to stderr once it accepts.
pub fn serve(
    engine: Engine,
    tokenizer: TextTokenizer,
    config: ServeConfig,
    listener: TcpListener,
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let context = engine.target.config.max_position_embeddings;
    let metrics = Arc::new(metrics::Metrics::default());
    let queued = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let decoder = {
        let (metrics, queued) = (metrics.clone(), queued.clone());
        std::thread::Builder::new()
            .name("dflash-scheduler".into())
            .spawn(move || scheduler::run(engine, rx, metrics, queued))?
    };
    let state = Arc::new(routes::AppState {
        model: config.model,
        tokenizer: Arc::new(tokenizer),
        jobs: Mutex::new(Some(tx)),
        metrics,
        queued,
        max_queue: config.max_queue,
        context,
        default_max_tokens: config.default_max_tokens,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let app = routes::router(state.clone());
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        eprintln!("listening on http://{addr}");
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal())
            .await
            .context("serving")
    })?;
    eprintln!("shutting down: finishing the requests in flight");
    // closing the channel ends the scheduler once its requests are done
    state.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    decoder
        .join()
        .map_err(|_| anyhow::anyhow!("the scheduler thread panicked"))?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
