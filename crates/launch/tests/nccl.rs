//! The NCCL start-up (feature `nccl`): on a machine without the NVIDIA driver or libnccl (CI),
//! `init_from_env(Backend::Nccl)` and `nccl_from_env` fail with kiln-comm's
//! `BackendUnavailable` naming the missing library, before any rendezvous; on a GPU machine,
//! without launcher variables, they give a world of one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_comm::{nccl, CommError, Communicator};
use kiln_launch::{init_from_env, nccl_from_env, Backend, LaunchEnv, LaunchError};
use std::time::Duration;

#[test]
fn nccl_start_up_is_backend_unavailable_without_the_libraries() {
    let env = LaunchEnv::from_vars(|_| None).unwrap();
    let direct = nccl_from_env(&env, 0, Duration::from_secs(30)).map(|c| c.world_size());
    let launched = init_from_env(Backend::Nccl).map(|l| l.comm.world_size());
    match nccl::available() {
        Ok(()) => {
            assert_eq!(direct.unwrap(), 1);
            assert_eq!(launched.unwrap(), 1);
            println!("the NVIDIA driver and NCCL are present: a world of one started");
        }
        Err(CommError::BackendUnavailable { reason, .. }) => {
            for got in [direct.unwrap_err(), launched.unwrap_err()] {
                match got {
                    LaunchError::Comm(CommError::BackendUnavailable {
                        backend: "nccl",
                        reason: r,
                    }) => assert_eq!(r, reason),
                    other => panic!("expected BackendUnavailable, got {other}"),
                }
            }
            println!("nccl unavailable, as expected on this machine: {reason}");
        }
        Err(other) => panic!("available() must be Ok or BackendUnavailable, got {other}"),
    }
}
