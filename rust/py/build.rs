//! Embeds every kernel source of the repository's top-level `cuda/` folder in the extension.
//!
//! The kernels are compiled at run time (NVRTC through CuPy), so the installed package must
//! carry their sources. Shipping them as package data would put a `cuda/` folder at the wheel
//! root, where it shadows the `cuda` namespace package of `cuda-bindings`; embedding them in
//! `kvpool._core` keeps the wheel's file list clean and the sources tied to the build.
//! New `.cu`/`.cuh` files are picked up without touching this file.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let cuda_dir =
        manifest.join("../../cuda").canonicalize().expect("the repository's cuda/ folder");
    println!("cargo:rerun-if-changed={}", cuda_dir.display());

    let mut names: Vec<String> = fs::read_dir(&cuda_dir)
        .expect("cuda/ is readable")
        .map(|entry| {
            entry.expect("cuda/ entry").file_name().into_string().expect("UTF-8 file name")
        })
        .filter(|name| name.ends_with(".cu") || name.ends_with(".cuh"))
        .collect();
    names.sort();

    let mut table =
        String::from("/// (file name, source text) of every kernel source, sorted by name.\n");
    table.push_str("pub static KERNEL_SOURCES: &[(&str, &str)] = &[\n");
    for name in &names {
        let path = cuda_dir.join(name);
        println!("cargo:rerun-if-changed={}", path.display());
        writeln!(table, "    ({name:?}, include_str!({:?})),", path.display().to_string())
            .expect("String write");
    }
    table.push_str("];\n");
    let out = PathBuf::from(env::var("OUT_DIR").expect("set by cargo")).join("kernel_sources.rs");
    fs::write(out, table).expect("OUT_DIR is writable");
}
