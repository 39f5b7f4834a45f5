//! The supervisor on small shell scripts: restarts with the resume and dp arguments, the
//! recovery time from a progress file, exhausted restarts, start-up failures and fatal codes.
//! (`tests/supervisor.rs` at the workspace root supervises the real trainer.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_launch::*;
use std::path::Path;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A fresh folder for one test.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-supervise-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `sh -c script sh`: the supervisor's arguments land in `$@`.
fn sh(script: String) -> SupervisorConfig {
    let mut cfg = SupervisorConfig::new("/bin/sh", &["-c", &script, "sh"]);
    cfg.poll = Duration::from_millis(2);
    cfg
}

fn event_names(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let rest = l.strip_prefix("{\"event\":\"").unwrap();
            rest[..rest.find('"').unwrap()].to_string()
        })
        .collect()
}

#[test]
fn crashes_are_restarted_with_resume_and_the_fallback_dp() {
    let d = dir("restart");
    let (count, argv) = (d.join("count"), d.join("argv"));
    // runs 1 and 2 kill themselves; run 3 succeeds with status 0
    let script = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; echo \"$@\" >> {a}; \
         if [ $n -lt 3 ]; then kill -9 $$; fi; exit 0",
        c = count.display(),
        a = argv.display()
    );
    let mut cfg = sh(script);
    cfg.args.extend(["--steps".into(), "10".into()]);
    cfg.restart_dp = vec![2, 1];
    cfg.events = Some(d.join("events.jsonl"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = Arc::clone(&seen);
    let out = Supervisor::new(cfg)
        .on_event(move |e| s2.lock().unwrap().push(e.name()))
        .restart_args_with(|k, exit| {
            assert_eq!(exit.signal, Some(9));
            vec![format!("--restart={k}").into()]
        })
        .run()
        .unwrap();
    assert!(out.success(), "{out:?}");
    assert_eq!((out.restarts(), out.exit_code()), (2, 0));
    let lines = std::fs::read_to_string(&argv).unwrap();
    assert_eq!(
        lines.lines().collect::<Vec<_>>(),
        [
            "--steps 10",
            "--steps 10 --resume --dp 2 --restart=1",
            "--steps 10 --resume --dp 1 --restart=2",
        ]
    );
    let want = [
        "start", "exit", "restart", "start", "exit", "restart", "start", "exit", "done",
    ];
    assert_eq!(event_names(&d.join("events.jsonl")), want);
    assert_eq!(*seen.lock().unwrap(), want);
    assert_eq!(
        out.attempts[0].exit,
        ChildExit {
            code: None,
            signal: Some(9)
        }
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn recovery_is_timed_from_the_crash_to_the_first_new_step_record() {
    let d = dir("progress");
    let (count, progress) = (d.join("count"), d.join("metrics.jsonl"));
    // each run: a header line, then step records from where it resumes; run 1 dies at step 3
    // leaving half a line behind, run 2 resumes at step 2 and finishes at step 4
    let script = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; p={p}; \
         sleep 0.2; echo '{{\"event\":\"info\",\"step\":0,\"message\":\"header\"}}' >> $p; \
         sleep 0.2; \
         if [ $n -eq 1 ]; then echo '{{\"step\":1}}' >> $p; echo '{{\"step\":2}}' >> $p; \
           printf '{{\"step\":3,\"lo' >> $p; kill -9 $$; fi; \
         echo '{{\"step\":3}}' >> $p; echo '{{\"step\":4}}' >> $p; exit 0",
        c = count.display(),
        p = progress.display()
    );
    let mut cfg = sh(script);
    cfg.progress = Some(progress.clone());
    cfg.events = Some(d.join("events.jsonl"));
    let out = Supervisor::new(cfg).run().unwrap();
    assert!(out.success(), "{out:?}");
    let (first, second) = (&out.attempts[0], &out.attempts[1]);
    assert_eq!(first.steps, Some((1, 2)));
    assert_eq!((first.up_s, first.recovery_s), (None, None));
    assert_eq!(second.steps, Some((3, 4)), "the half line is not read");
    let (up, rec) = (second.up_s.unwrap(), second.recovery_s.unwrap());
    assert!(
        (0.15..5.0).contains(&up) && rec >= up + 0.15 && rec < 5.0,
        "up {up} s, recovery {rec} s"
    );
    let events = std::fs::read_to_string(d.join("events.jsonl")).unwrap();
    let recovered = events.lines().find(|l| l.contains("recovered")).unwrap();
    assert!(
        recovered.contains("\"attempt\":1") && recovered.contains("\"step\":3"),
        "{recovered}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn exhausted_restarts_end_with_the_last_status() {
    let d = dir("exhausted");
    let mut cfg = sh("kill -9 $$".into());
    cfg.max_restarts = 1;
    cfg.events = Some(d.join("events.jsonl"));
    let out = Supervisor::new(cfg).run().unwrap();
    assert_eq!(out.restarts(), 1);
    assert_eq!(out.exit_code(), 137);
    let SuperviseEnd::Exhausted(msg) = &out.end else {
        panic!("{out:?}")
    };
    assert!(msg.contains("signal 9 (SIGKILL)") && msg.contains("restart(s) are spent"));
    assert_eq!(
        event_names(&d.join("events.jsonl")),
        ["start", "exit", "restart", "start", "exit", "gave_up"]
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn start_up_failures_and_fatal_codes_are_not_restarted() {
    let d = dir("fatal");
    // exit 1 before writing progress: a configuration error
    let mut cfg = sh("exit 1".into());
    cfg.progress = Some(d.join("metrics.jsonl"));
    let out = Supervisor::new(cfg.clone()).run().unwrap();
    assert_eq!((out.restarts(), out.exit_code()), (0, 1));
    assert!(matches!(&out.end, SuperviseEnd::Failed(m) if m.contains("before writing anything")));
    // the same without a progress file: restarted (torchrun's rule)
    cfg.progress = None;
    cfg.max_restarts = 2;
    let out = Supervisor::new(cfg).run().unwrap();
    assert_eq!(out.restarts(), 2);
    assert!(matches!(out.end, SuperviseEnd::Exhausted(_)));
    // a fatal code, after progress
    let p = d.join("m2.jsonl");
    let mut cfg = sh(format!("echo '{{\"step\":1}}' >> {}; exit 78", p.display()));
    cfg.progress = Some(p);
    let out = Supervisor::new(cfg).run().unwrap();
    assert_eq!((out.restarts(), out.exit_code()), (0, 78));
    assert!(matches!(&out.end, SuperviseEnd::Failed(m) if m.contains("configuration error")));
    // a program that does not exist is the supervisor's error
    let e = Supervisor::new(SupervisorConfig::new("/nonexistent/kiln", &["x"]))
        .run()
        .unwrap_err();
    assert!(e.to_string().contains("cannot start"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn resume_args_are_not_repeated() {
    let mut cfg = SupervisorConfig::new("p", &["--resume", "--steps", "3"]);
    assert!(cfg.restart_args(1).is_empty());
    cfg.restart_dp = vec![4];
    assert_eq!(cfg.restart_args(3), ["--dp", "4"]);
    cfg.args = vec!["--steps".into()];
    assert_eq!(cfg.restart_args(1), ["--resume", "--dp", "4"]);
}
