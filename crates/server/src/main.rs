//! The `warren` binary.

use clap::{Parser, Subcommand};
use warren_server::config::{Config, ServerArgs};
use warren_server::{ctl, server};
// Not eprintln!: it panics when stderr is a closed pipe.
use warren_bench::output;

#[derive(Parser)]
#[command(name = "warren", version, about = "Warren: a message broker that speaks AMQP 0-9-1")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a broker node.
    Server(ServerArgs),
    /// Load any AMQP 0-9-1 broker (Warren or RabbitMQ) and report rates and latencies.
    Bench(warren_bench::BenchArgs),
    /// Ask a running node about its cluster or change it (cluster port); list and change queues,
    /// exchanges, bindings, connections and definitions (management API).
    Ctl(ctl::CtlArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Server(args) => run_server(args),
        Command::Bench(args) => warren_bench::run(args),
        Command::Ctl(args) => ctl::run(args),
    }
}

/// The log filter: openraft logs every vote and election at `info`, so its level is `warn` unless
/// the filter names it (e.g. `info,openraft=info`).
fn log_filter(configured: &str) -> String {
    if configured.contains("openraft") {
        configured.to_owned()
    } else {
        format!("{configured},openraft=warn")
    }
}

fn run_server(args: ServerArgs) -> std::process::ExitCode {
    let config = match Config::load(&args).and_then(|c| c.validate().map(|_| c)) {
        Ok(c) => c,
        Err(e) => {
            output::stderr(format_args!("warren: {e}\n"));
            return std::process::ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::new(log_filter(&std::env::var("WARREN_LOG").unwrap_or_else(|_| config.log.clone())));
    // A log reader that went away (`warren server 2>&1 | head`) must not stop the broker: without
    // this, each failed write is reported with eprintln!, which panics once stderr is closed too.
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).log_internal_errors(false).init();
    tracing::info!("starting Warren {} ({})", env!("CARGO_PKG_VERSION"), config.summary());
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("warren").build() {
        Ok(rt) => rt,
        Err(e) => {
            output::stderr(format_args!("warren: cannot start the runtime: {e}\n"));
            return std::process::ExitCode::FAILURE;
        }
    };
    let reload: server::Reload = Box::new(move || Config::load(&args).and_then(|c| c.validate().map(|_| c)));
    match runtime.block_on(server::run(config, reload)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            output::stderr(format_args!("warren: {e}\n"));
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod cli_tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn every_ctl_command_parses() {
        Cli::command().debug_assert();
        for args in [
            &["warren", "ctl", "--node", "127.0.0.1:1", "cluster-status", "--json"][..],
            &["warren", "ctl", "rebalance"],
            &["warren", "ctl", "--node", "127.0.0.1:1", "transfer-leader", "5", "2"],
            &["warren", "ctl", "add-node", "4", "127.0.0.1:2"],
            &["warren", "ctl", "remove-node", "4"],
            &["warren", "ctl", "grow", "4"],
            &["warren", "ctl", "--url", "http://h:1", "list", "queues", "--all-vhosts", "--json"],
            &["warren", "ctl", "declare", "queue", "q", "--type", "quorum", "--arg", "x-max-length=1"],
            &["warren", "ctl", "declare", "binding", "e", "q", "--routing-key", "k", "--vhost", "v"],
            &["warren", "ctl", "delete", "exchange", "e", "--if-unused"],
            &["warren", "ctl", "purge", "q"],
            &["warren", "ctl", "close-connection", "c", "--reason", "r"],
            &["warren", "ctl", "export", "-"],
            &["warren", "ctl", "get", "q", "--count", "3", "--ackmode", "ack_requeue_false"],
            &["warren", "ctl", "publish", "--routing-key", "q", "--payload", "p", "--user", "u", "--password", "p"],
        ] {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert!(matches!(cli.command, Command::Ctl(_)));
        }
        let Command::Ctl(c) = Cli::parse_from(["warren", "ctl", "--node", "h:1", "transfer-leader", "5", "2"]).command else { unreachable!() };
        assert_eq!(c.node.as_deref(), Some("h:1"));
        assert!(matches!(c.command, ctl::CtlCommand::TransferLeader { group: 5, to: 2 }));
    }
}
