//! The `dflash-rs` binary.

mod args;
mod bench_cmd;
mod bench_regen;
mod bench_shape;
mod bench_train;
mod check_cmd;
#[cfg(test)]
mod cli_doc;
mod drafter_cmd;
mod eval_cmd;
mod forward_cmd;
mod generate;
mod launch;
mod serve_cmd;
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
    /// Fused kernels and paths to turn off, comma-separated (`attention` names every fused
    /// attention kernel; docs/ENVIRONMENT.md lists them): the composed ops run instead, for A/B
    /// comparisons. Default: `DFLASH_DISABLED_KERNELS`, else none.
    #[arg(long, global = true, value_name = "NAMES")]
    disable_kernels: Option<String>,
}

/// The runtime configuration: the environment's defaults ([`dflash_core::env`]) under the
/// command line's flags.
fn runtime_config(cli: &Cli) -> anyhow::Result<dflash_core::runtime::RuntimeConfig> {
    let mut config = dflash_core::runtime::RuntimeConfig::from_env();
    if let Some(list) = &cli.disable_kernels {
        config.kernels = dflash_core::runtime::KernelPlan::parse(list)
            .map_err(|e| anyhow::anyhow!("--disable-kernels: {e}"))?;
    }
    Ok(config)
}

#[derive(Subcommand)]
enum Command {
    /// Generate text with a target model (AR or speculative).
    Generate(generate::GenerateArgs),
    /// Serve the target over an OpenAI-compatible HTTP API (chat, completions, streaming,
    /// metrics), speculative where a request decodes alone.
    Serve(serve_cmd::ServeArgs),
    /// Training data.
    #[command(subcommand)]
    Data(train_cmd::DataCommand),
    /// Train a drafter.
    Train(train_cmd::TrainArgs),
    /// Evaluate drafters: τ, DDTree-N, speed-up, losslessness, reports and plots.
    Eval(eval_cmd::EvalArgs),
    /// Check a target/drafter pair for train/eval mismatches.
    Doctor(eval_cmd::DoctorArgs),
    /// Benchmarks: decoding per mode, model shapes without weights, the training step.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Checks of the machine: a device against the CPU.
    #[command(subcommand)]
    Check(CheckCommand),
    /// Drafter checkpoints.
    #[command(subcommand)]
    Drafter(drafter_cmd::DrafterCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Time per output token per mode, and one target forward against its floor.
    Decode(bench_cmd::BenchArgs),
    /// Costs of a model shape without weights (random, e.g. Qwen3-8B) and the speed-up model.
    Shape(bench_shape::BenchShapeArgs),
    /// The drafter's training step on a model shape without weights: time, tokens/s, MFU.
    Train(bench_train::BenchTrainArgs),
    /// Data regeneration's batched decoding on a model shape without weights: tokens/s.
    Regen(bench_regen::BenchRegenArgs),
}

#[derive(Subcommand)]
enum CheckCommand {
    /// Compare a device (CUDA) against the CPU: kernels, logits, taps, AR, DFlash/DDTree
    /// losslessness, CUDA graphs.
    Device(check_cmd::DeviceCheckArgs),
    /// One prefill's logits and taps of a model directory written to safetensors, to compare
    /// with another stack (transformers, fla) on the same weights and tokens.
    Forward(forward_cmd::ForwardArgs),
}

fn main() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    // `DFLASH_PROFILE`: time per phase (dflash_model::profile), printed by the long loops
    let phases = dflash_model::profile::requested().then_some(dflash_model::profile::PhaseLayer);
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(filter),
        )
        .with(phases)
        .init();
    let cli = Cli::parse();
    match runtime_config(&cli) {
        Ok(config) => dflash_core::runtime::install(config),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Drafter(c) => drafter_cmd::run(c),
        Command::Data(c) => train_cmd::run_data(c),
        Command::Train(a) => train_cmd::run_train(a),
        Command::Eval(a) => eval_cmd::run_eval(a),
        Command::Doctor(a) => eval_cmd::run_doctor(a),
        Command::Bench(BenchCommand::Decode(a)) => bench_cmd::run(a),
        Command::Bench(BenchCommand::Shape(a)) => bench_shape::run(a),
        Command::Bench(BenchCommand::Train(a)) => bench_train::run(a),
        Command::Bench(BenchCommand::Regen(a)) => bench_regen::run(a),
        Command::Check(CheckCommand::Device(a)) => check_cmd::run(a),
        Command::Check(CheckCommand::Forward(a)) => forward_cmd::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
