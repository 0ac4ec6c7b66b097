//! The `huddle` CLI, built as part of this package so integration tests can
//! find it (`CARGO_BIN_EXE_hc-huddle`) after a plain `cargo test`.
fn main() -> std::process::ExitCode {
    huddle_user::cli::main()
}
