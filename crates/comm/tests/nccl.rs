//! The NCCL backend (feature `nccl`). On a machine without the NVIDIA driver or libnccl (CI),
//! creating a communicator must be `CommError::BackendUnavailable` naming the missing library,
//! never a panic or a hang. On a GPU machine: collectives on device buffers and on host slices
//! at world 1, uneven chunks, a split, and the capabilities.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_comm::nccl::{available, NcclComm, NcclId};
use kiln_comm::{CommError, CommExt, Communicator, ReduceOp};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);

/// The reason the backend is unavailable here, or `None` when it is available.
fn unavailable() -> Option<String> {
    match available() {
        Ok(()) => None,
        Err(CommError::BackendUnavailable { backend, reason }) => {
            assert_eq!(backend, "nccl");
            Some(reason)
        }
        Err(other) => panic!("available() must be Ok or BackendUnavailable, got {other}"),
    }
}

#[test]
fn without_the_libraries_creating_a_communicator_is_backend_unavailable() {
    let Some(reason) = unavailable() else {
        println!(
            "the NVIDIA driver and NCCL are present: the unavailable path is not reachable here"
        );
        return;
    };
    assert!(
        reason.contains("libcuda") || reason.contains("libnccl"),
        "the reason names the library: {reason}"
    );
    // every way in gives the same typed error, with nothing started
    for err in [
        NcclId::new().map(|_| ()).unwrap_err(),
        NcclComm::new(0, 0, 1, NcclId::from_bytes(&[0; 128]).unwrap(), TIMEOUT)
            .map(|_| ())
            .unwrap_err(),
    ] {
        match err {
            CommError::BackendUnavailable {
                backend: "nccl",
                reason: r,
            } => assert_eq!(r, reason),
            other => panic!("expected BackendUnavailable, got {other}"),
        }
    }
    println!("nccl unavailable, as expected on this machine: {reason}");
}

#[test]
fn unique_ids_round_trip_and_bad_lengths_are_errors() {
    let e = NcclId::from_bytes(&[1; 12]).unwrap_err().to_string();
    assert!(e.contains("128") && e.contains("12"), "{e}");
    let id = NcclId::from_bytes(&(0..128).map(|i| i as u8).collect::<Vec<_>>()).unwrap();
    assert_eq!(id.to_bytes(), (0..128).map(|i| i as u8).collect::<Vec<_>>());
}

#[test]
fn world_of_one_on_a_gpu() {
    if let Some(reason) = unavailable() {
        println!("world_of_one_on_a_gpu: skipped, {reason}");
        return;
    }
    let comm = match NcclComm::new(0, 0, 1, NcclId::new().unwrap(), TIMEOUT) {
        Ok(c) => c,
        Err(CommError::BackendUnavailable { reason, .. }) => {
            println!("world_of_one_on_a_gpu: skipped, {reason}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let caps = comm.capabilities();
    assert!(caps.device_buffers && caps.even_chunks_only && !caps.rank_ordered);
    // host slices: identities at world 1, uneven lengths, every dtype path
    let mut v = vec![1.5f32, -2.0, 3.25];
    comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v, [1.5, -2.0, 3.25]);
    let mut i = vec![7i64, -3];
    comm.all_reduce(&mut i, ReduceOp::Avg).unwrap();
    assert_eq!(i, [7, -3]);
    let mut out = vec![0.0f64; 5];
    comm.reduce_scatter(&[1.0, 2.0, 3.0, 4.0, 5.0], &mut out, ReduceOp::Max)
        .unwrap();
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 5.0]);
    let mut g = vec![half::bf16::ZERO; 3];
    comm.all_gather(&[half::bf16::ONE; 3], &mut g).unwrap();
    assert_eq!(g, [half::bf16::ONE; 3]);
    comm.barrier().unwrap();
    let bad = comm.all_gather(&[1.0f32; 2], &mut [0.0f32; 3]).unwrap_err();
    assert!(matches!(bad, CommError::BadLength { .. }), "{bad}");
    // device buffers in place
    let stream = comm.stream().clone();
    let mut d = stream.clone_htod(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    comm.all_reduce_device(&mut d, ReduceOp::Avg).unwrap();
    assert_eq!(stream.clone_dtoh(&d).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    let mut many = [
        stream.clone_htod(&[1.0f32; 8]).unwrap(),
        stream.clone_htod(&[2.0f32; 3]).unwrap(),
    ];
    comm.all_reduce_many_device(&mut many, ReduceOp::Sum)
        .unwrap();
    assert_eq!(stream.clone_dtoh(&many[1]).unwrap(), [2.0; 3]);
    // a split of a world of one is a world of one
    let sub = comm.split(0, 0).unwrap();
    assert_eq!(
        (sub.rank(), sub.world_size(), sub.backend()),
        (0, 1, "nccl")
    );
    let mut s = vec![4u32];
    sub.all_reduce(&mut s, ReduceOp::Sum).unwrap();
    assert_eq!(s, [4]);
    println!("world_of_one_on_a_gpu: host and device collectives and split on NCCL");
}
