//! Builds the embedded default's weights into the library when they are in the tree
//! (`assets/world/{dit,ae}.safetensors`): `cfg(world_assets)`.

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(world_assets)");
    println!("cargo::rerun-if-changed=assets/world");
    let dir = Path::new("assets/world");
    for f in ["dit.safetensors", "ae.safetensors", "TRAINING.md"] {
        println!("cargo::rerun-if-changed=assets/world/{f}");
    }
    if dir.join("dit.safetensors").is_file() && dir.join("ae.safetensors").is_file() {
        println!("cargo::rustc-cfg=world_assets");
    }
}
