//! CUDA graphs: capture the work a closure enqueues on a stream once, replay it cheaply.

use super::context::Stream;
use super::driver::{self, CUgraph, CUgraphExec};
use super::error::CudaError;

/// An instantiated graph captured from a stream.
pub struct Graph {
    ctx: std::sync::Arc<super::Context>,
    graph: CUgraph,
    exec: CUgraphExec,
}

// SAFETY: graph handles may be launched from any thread once the context is bound (done per call).
unsafe impl Send for Graph {}

impl Graph {
    /// Capture everything `f` enqueues on `stream` (thread-local capture mode) into a graph. The
    /// work is recorded, not run.
    pub fn capture(
        stream: &Stream,
        f: impl FnOnce(&Stream) -> Result<(), CudaError>,
    ) -> Result<Graph, CudaError> {
        let ctx = stream.context().clone();
        ctx.bind()?;
        driver::stream_begin_capture(stream.raw())?;
        let body = f(stream);
        // Always end the capture, even when the body failed, so the stream is usable again.
        let ended = driver::stream_end_capture(stream.raw());
        let graph = match (body, ended) {
            (Ok(()), Ok(g)) => g,
            (Err(e), Ok(g)) => {
                if !g.is_null() {
                    // SAFETY: the graph was just created and nothing else refers to it.
                    let _ = unsafe { (driver::api()?.cuGraphDestroy)(g) };
                }
                return Err(e);
            }
            (Err(e), Err(_)) | (Ok(()), Err(e)) => return Err(e),
        };
        let exec = match driver::graph_instantiate(graph) {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: as above.
                let _ = unsafe { (driver::api()?.cuGraphDestroy)(graph) };
                return Err(e);
            }
        };
        Ok(Graph { ctx, graph, exec })
    }

    /// Enqueue one replay of the graph on `stream`.
    pub fn replay(&self, stream: &Stream) -> Result<(), CudaError> {
        self.ctx.bind()?;
        driver::graph_launch(self.exec, stream.raw())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: we own both handles; nothing uses them after drop.
        let destroy = || unsafe { driver::graph_destroy(self.exec, self.graph) };
        self.ctx.release(|| "a CUDA graph".into(), destroy);
    }
}
