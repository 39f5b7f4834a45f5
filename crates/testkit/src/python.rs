//! Python as the independent other side of a test (Python's `safetensors`, TensorBoard,
//! `tokenizers`, a numpy GPT-2), with one rule for when such a test may skip.
//!
//! A test may skip only where the interpreter or one of the modules it names is missing: then
//! it prints why and how to install it. Under `CI=true` that is a failure too, since `.ci/run`
//! installs them (unless the test says CI does not, [`Python::optional`]). Anything else is a
//! failure showing Python's stderr: an import that fails for another reason (a broken install),
//! and any failure of the test's own script once the modules import.

use std::ffi::{OsStr, OsString};
use std::process::Command;

/// Whether this is CI's run (`CI=true`), where a missing dependency that `.ci/run` installs
/// fails the test rather than skipping it.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Imports each module named on the command line; exits with [`MISSING_EXIT`] and a
/// [`MISSING_MARK`] line when a module itself is not installed, and lets any other error (a
/// module that is there but fails to import, one of its own dependencies missing) end the
/// script with its traceback.
const PROBE: &str = r#"
import importlib, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as e:
        if e.name is not None and (m == e.name or m.startswith(e.name + ".")):
            print("kiln-missing-module:", m, "(" + str(e) + ")", file=sys.stderr)
            sys.exit(3)
        raise
"#;
const MISSING_EXIT: i32 = 3;
const MISSING_MARK: &str = "kiln-missing-module:";

/// A Python interpreter that has imported every module a test needs.
#[derive(Debug, Clone)]
pub struct Python {
    program: OsString,
}

impl Python {
    /// `python3` with every module in `modules` importable (dotted names allowed), for the
    /// test called `test`; `None`, with the reason and `pip install` line printed, where
    /// `python3` or one of the modules is missing.
    ///
    /// # Panics
    ///
    /// Under `CI=true` where something is missing (`.ci/run` installs these modules), and
    /// wherever a module is installed but fails to import (its stderr in the message).
    pub fn require(test: &str, modules: &[&str]) -> Option<Python> {
        let program = OsString::from("python3");
        match probe(&program, modules) {
            Ok(()) => Some(Python { program }),
            Err(why) => {
                let pip = pip_line(modules);
                assert!(
                    !under_ci(),
                    "{test}: CI=true, and .ci/run installs its Python modules ({pip}), but {why}"
                );
                println!("SKIPPED {test}: {why} ({pip})");
                None
            }
        }
    }

    /// [`Python::require`] with the interpreter `program`, for modules CI does not install:
    /// where something is missing the test skips with the reason printed, under `CI=true`
    /// too. A module that is installed but fails to import still panics.
    pub fn optional(program: impl AsRef<OsStr>, test: &str, modules: &[&str]) -> Option<Python> {
        let program = program.as_ref().to_os_string();
        match probe(&program, modules) {
            Ok(()) => Some(Python { program }),
            Err(why) => {
                println!("SKIPPED {test}: {why} ({})", pip_line(modules));
                None
            }
        }
    }

    /// A command running this interpreter.
    pub fn command(&self) -> Command {
        Command::new(&self.program)
    }

    /// Runs the interpreter with `args` (a script path, or `-c` and a script, then its
    /// arguments) and returns what it printed to stdout.
    ///
    /// # Panics
    ///
    /// When it cannot start or exits with a failure, with its status and stderr; `what` names
    /// the script in the message.
    pub fn run<I, S>(&self, what: &str, args: I) -> String
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self
            .command()
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{what}: cannot start {:?}: {e}", self.program));
        assert!(
            out.status.success(),
            "{what} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// `Ok` when `program` imports every module; `Err(why)` when the interpreter or a module is
/// missing; panics on any other failure.
fn probe(program: &OsStr, modules: &[&str]) -> Result<(), String> {
    probe_with(Command::new(program), modules)
}

/// [`probe`] with the interpreter's command prepared by the caller (its environment).
fn probe_with(mut cmd: Command, modules: &[&str]) -> Result<(), String> {
    let name = cmd.get_program().to_string_lossy().into_owned();
    let out = match cmd.arg("-c").arg(PROBE).args(modules).output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("{name} is not installed ({e})"))
        }
        Err(e) => panic!("cannot start {name}: {e}"),
    };
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(MISSING_EXIT) {
        if let Some(line) = stderr.lines().find_map(|l| l.strip_prefix(MISSING_MARK)) {
            return Err(format!("{name} lacks the module{}", line));
        }
    }
    panic!(
        "{name} failed to import {} other than for a missing module ({}):\n{stderr}",
        modules.join(", "),
        out.status
    );
}

/// `pip install` and the top-level packages of `modules`.
fn pip_line(modules: &[&str]) -> String {
    let mut top: Vec<&str> = modules
        .iter()
        .map(|m| m.split('.').next().unwrap_or(m))
        .collect();
    top.dedup();
    format!("pip install {}", top.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn have_python3() -> bool {
        Command::new("python3")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    #[test]
    fn a_missing_module_is_missing() {
        if !have_python3() {
            println!("skipped: no python3 to probe with");
            return;
        }
        let why = probe(
            OsStr::new("python3"),
            &["json", "kiln_no_such_module_anywhere"],
        )
        .unwrap_err();
        assert!(why.contains("kiln_no_such_module_anywhere"), "{why}");
        assert!(probe(OsStr::new("python3"), &["json", "os.path"]).is_ok());
    }

    #[test]
    fn a_missing_interpreter_is_missing() {
        let why = probe(OsStr::new("kiln-no-such-python"), &["json"]).unwrap_err();
        assert!(
            why.contains("kiln-no-such-python is not installed"),
            "{why}"
        );
    }

    #[test]
    fn a_module_that_fails_to_import_is_a_failure() {
        if !have_python3() {
            println!("skipped: no python3 to probe with");
            return;
        }
        // modules that are there but fail to import: a broken install, not a skip
        let dir = std::env::temp_dir().join(format!("kiln-testkit-py-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("kiln_broken_mod.py"),
            "raise RuntimeError('broken')\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("kiln_dep_mod.py"),
            "import kiln_absent_dependency\n",
        )
        .unwrap();
        for (module, says) in [
            ("kiln_broken_mod", "RuntimeError: broken"),
            ("kiln_dep_mod", "No module named 'kiln_absent_dependency'"),
        ] {
            let r = std::panic::catch_unwind(|| {
                let mut cmd = Command::new("python3");
                cmd.env("PYTHONPATH", &dir);
                probe_with(cmd, &[module])
            });
            let msg = r.expect_err(module);
            let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(
                msg.contains("other than for a missing module") && msg.contains(says),
                "{module}: {msg}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
