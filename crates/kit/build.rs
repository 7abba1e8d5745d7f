//! refinery's `embed_migrations!` reads `migrations/` at compile time; make cargo
//! rebuild this crate whenever a migration file changes.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
