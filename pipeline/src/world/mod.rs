//! The procedural world of the embedded default model: a fixed scene of rooms and corridors
//! ([`Scene`]), a ray-casting [`Renderer`] that sees it through the engine's camera (the same
//! [`CameraRig`](crate::camera::CameraRig) integrator and intrinsics as the DiT's ray map),
//! random and scripted trajectories, and the training-set exporter ([`dataset`]).
//!
//! Frames: the rig's poses are relative to the session start; the scene sees them through a
//! spawn pose (a level pose in the scene), `world = spawn · rig`. The DiT's camera input only
//! depends on relative poses, so the spawn changes the picture, not the conditioning.

pub mod assets;
pub mod dataset;
pub mod metrics;
pub mod npy;
pub mod render;
pub mod scene;
pub mod trajectory;
pub mod verify;

pub use render::Renderer;
pub use scene::Scene;
pub use trajectory::{Split, Trajectory};
