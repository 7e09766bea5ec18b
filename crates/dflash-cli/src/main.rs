//! The `dflash-rs` binary.

mod args;
mod bench_cmd;
mod bench_shape;
mod bench_train;
mod check_cmd;
mod drafter_cmd;
mod eval_cmd;
mod generate;
mod timing;
mod train_cmd;

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
    /// Training data.
    #[command(subcommand)]
    Data(train_cmd::DataCommand),
    /// Train a drafter.
    Train(train_cmd::TrainArgs),
    /// Plot a training run's loss and simulated τ (metrics.jsonl → SVG).
    TrainCurves(train_cmd::CurvesArgs),
    /// Evaluate drafters: τ, DDTree-N, speed-up, losslessness, reports and plots.
    Eval(eval_cmd::EvalArgs),
    /// Check a target/drafter pair for train/eval mismatches.
    Doctor(eval_cmd::DoctorArgs),
    /// Compare a device (CUDA) against the CPU: logits, taps, AR, DFlash/DDTree losslessness.
    DeviceCheck(check_cmd::DeviceCheckArgs),
    /// Time per output token per mode, and one target forward against its floor.
    Bench(bench_cmd::BenchArgs),
    /// Costs of a model shape without weights (random, e.g. Qwen3-8B) and the speed-up model.
    BenchShape(bench_shape::BenchShapeArgs),
    /// The drafter's training step on a model shape without weights: time, tokens/s, MFU.
    BenchTrain(bench_train::BenchTrainArgs),
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
        Command::Data(c) => train_cmd::run_data(c),
        Command::Train(a) => train_cmd::run_train(a),
        Command::TrainCurves(a) => train_cmd::run_curves(a),
        Command::Eval(a) => eval_cmd::run_eval(a),
        Command::DeviceCheck(a) => check_cmd::run(a),
        Command::Bench(a) => bench_cmd::run(a),
        Command::BenchShape(a) => bench_shape::run(a),
        Command::BenchTrain(a) => bench_train::run(a),
        Command::Doctor(a) => eval_cmd::run_doctor(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
