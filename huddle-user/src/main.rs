fn main() -> std::process::ExitCode {
    huddle_user::cli::main()
}
