//! kiln's local launcher against real processes: this test binary starts itself once per rank
//! through `LocalLaunch`; each child reads its launcher variables, meets the others at the
//! rendezvous store and reports. A child that fails makes the launcher stop the others (one of
//! them blocked waiting for a rank that never arrives) and name the failed rank.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_launch::{LaunchEnv, LocalLaunch, TcpStore};
use std::ffi::OsString;
use std::time::{Duration, Instant};

/// In a child: what the parent asked for (`KILN_LAUNCH_CHILD`), else `None`. The parent sets
/// that variable in its own environment before it launches, so the harness's own run of
/// `child_entry`, in parallel with the launching test, may see it too: only a process the
/// launcher started also has `RANK`.
fn child_mode() -> Option<String> {
    std::env::var_os("RANK")?;
    std::env::var("KILN_LAUNCH_CHILD").ok()
}

/// The body of one launched process.
#[test]
fn child_entry() {
    let Some(mode) = child_mode() else {
        return; // run directly by the test harness: nothing to do
    };
    let env = LaunchEnv::from_env().unwrap();
    let out = std::path::PathBuf::from(std::env::var("KILN_LAUNCH_OUT").unwrap());
    if mode == "fail" && env.rank == 1 {
        std::process::exit(3);
    }
    let store = TcpStore::for_rank(&env, Duration::from_secs(60)).unwrap();
    // every rank arrives (in "fail" mode rank 0 waits here for rank 1 until it is stopped)
    let who = store.check_in(env.rank, env.world_size).unwrap();
    // rank 0 hosts the store: it leaves only once every rank has read what it needed
    store.set(&format!("done/{}", env.rank), b"1").unwrap();
    if env.rank == 0 {
        for r in 0..env.world_size {
            store.get(&format!("done/{r}")).unwrap();
        }
    }
    std::fs::write(
        out.join(format!("rank{}", env.rank)),
        format!(
            "{} {} {} {} {} {} {}",
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size.unwrap_or(0),
            who.len(),
            env.store_token.source(),
            env.store_token.value()
        ),
    )
    .unwrap();
}

fn launch(
    mode: &str,
    nproc: usize,
    port: u16,
) -> (kiln_launch::LaunchOutcome, std::path::PathBuf, Duration) {
    let out = std::env::temp_dir().join(format!("kiln_launch_{mode}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    std::env::set_var("KILN_LAUNCH_CHILD", mode);
    std::env::set_var("KILN_LAUNCH_OUT", &out);
    let l = LocalLaunch {
        nproc_per_node: nproc,
        master_port: port,
        grace: Duration::from_secs(2),
        ..Default::default()
    };
    let exe: OsString = std::env::current_exe().unwrap().into();
    let args: Vec<OsString> = [
        "--exact",
        "child_entry",
        "--nocapture",
        "--test-threads",
        "1",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let t0 = Instant::now();
    let outcome = l.run(&exe, &args).unwrap();
    (outcome, out, t0.elapsed())
}

#[test]
fn launches_one_process_per_rank_and_stops_them_all_when_one_fails() {
    if child_mode().is_some() {
        return;
    }
    // the environment is shared by both launches: run them one after the other here
    let (ok, out, _) = launch("ok", 3, 29731);
    assert!(ok.success(), "{ok:?}");
    assert_eq!(ok.codes, vec![Some(0); 3]);
    // every rank got the launcher's random token, the same one, and the store admitted them
    let mut tokens = Vec::new();
    for r in 0..3 {
        let s = std::fs::read_to_string(out.join(format!("rank{r}"))).unwrap();
        let (head, token) = s.rsplit_once(' ').unwrap();
        assert_eq!(head, format!("{r} 3 {r} 3 3 KILN_STORE_TOKEN"), "rank {r}");
        assert_eq!(token.len(), 32, "{token}");
        tokens.push(token.to_string());
    }
    assert!(tokens.iter().all(|t| t == &tokens[0]), "{tokens:?}");
    let (bad, out, took) = launch("fail", 2, 29732);
    assert!(!bad.success());
    assert_eq!(bad.first_failure, Some((1, "exit code 3".to_string())));
    assert_eq!(bad.codes[1], Some(3));
    // rank 0 was blocked in the rendezvous and was stopped, not left waiting 60 s
    assert!(bad.codes[0] != Some(0), "{bad:?}");
    assert!(!out.join("rank0").exists());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    println!("launcher: 3 ranks ran; a failed rank 1 stopped rank 0 after {took:?}");
}

#[test]
fn bad_numbers_and_missing_programs_are_errors() {
    if child_mode().is_some() {
        return;
    }
    let l = LocalLaunch {
        nproc_per_node: 2,
        nnodes: 2,
        node_rank: 2,
        ..Default::default()
    };
    let e = l.validate().unwrap_err().to_string();
    assert!(e.contains("--node-rank 2"), "{e}");
    let l = LocalLaunch {
        nproc_per_node: 2,
        master_port: 29733,
        ..Default::default()
    };
    let e = l
        .run(&OsString::from("/nonexistent/kiln-program"), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/kiln-program") && e.contains("local rank 0"),
        "{e}"
    );
    assert_eq!(
        l.env_for(1),
        vec![
            ("RANK", "1".to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", "1".into()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("GROUP_RANK", "0".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", "29733".into()),
        ]
    );
}
