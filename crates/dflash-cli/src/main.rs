//! The `dflash-rs` binary.

mod drafter_cmd;
mod generate;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "dflash-rs",
    version,
    about = "DFlash speculative decoding: generate, train, evaluate"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text with a target model (AR or speculative).
    Generate(generate::GenerateArgs),
    /// Drafter checkpoints.
    #[command(subcommand)]
    Drafter(drafter_cmd::DrafterCommand),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Drafter(c) => drafter_cmd::run(c),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
