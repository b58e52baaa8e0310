//! The Worldline worker as a library: model setup, decoding, and the HTTP/WebSocket server
//! (`server`). The `worker` binary is a thin command line over it; tests drive the server
//! in-process through [`server::Server::run`].

pub mod decode;
#[cfg(feature = "media")]
pub mod media;
pub mod server;
pub mod setup;
pub mod stream;
pub mod text;
pub mod y4m;
