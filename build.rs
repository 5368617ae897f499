//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!`
//! embeds the `migrations` directories at compile time, and cargo would not
//! otherwise look at them.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
