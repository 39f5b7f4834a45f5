//! The `kiln` command: `kiln --help` lists the subcommands, `kiln <subcommand> --help` their
//! flags.

// freed activation-sized blocks are kept for the next step instead of page-faulted back in
#[global_allocator]
static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;

fn main() -> std::process::ExitCode {
    kiln_cli::main()
}
