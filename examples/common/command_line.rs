//! The command line of the examples that start another program (`launch`, `supervise`):
//! their own flags, `--`, then the program and its arguments.

use std::ffi::OsString;

/// Splits `args` at the first `--` into (own flags, program, program arguments); errors carry
/// `usage`.
pub fn split_command(
    args: &[OsString],
    usage: &str,
) -> anyhow::Result<(Vec<OsString>, OsString, Vec<OsString>)> {
    let split = args
        .iter()
        .position(|a| a == "--")
        .ok_or_else(|| anyhow::anyhow!("no `--` before the program\n{usage}"))?;
    let (program, program_args) = args[split + 1..]
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("no program after `--`\n{usage}"))?;
    Ok((
        args[..split].to_vec(),
        program.clone(),
        program_args.to_vec(),
    ))
}
