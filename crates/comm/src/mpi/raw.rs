//! The MPI calls the backend makes, each wrapped once: return codes become [`CommError`]s and
//! communicators travel as Fortran handles (plain integers, valid on every thread under
//! `MPI_THREAD_MULTIPLE`).

use crate::error::{CommError, Result};
use ::mpi::ffi;
use std::ffi::{c_int, c_void};

/// A communicator as its Fortran handle: an integer that `MPI_Comm_f2c` turns back into the C
/// handle on any thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CommHandle(ffi::RSMPI_Fint);

/// An outstanding non-blocking operation.
pub(crate) type Request = ffi::MPI_Request;

pub(crate) fn err(call: &str, message: impl std::fmt::Display) -> CommError {
    CommError::Backend {
        backend: "mpi",
        message: format!("{call}: {message}"),
    }
}

/// Turns an MPI return code into a result, with MPI's own text for the code.
fn check(code: c_int, call: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let mut text = [0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes into
    // `text`, which has 512, and the length into `len`.
    let ok = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) };
    let text = if ok == 0 {
        let n = usize::try_from(len).unwrap_or(0).min(text.len());
        String::from_utf8_lossy(&text[..n]).into_owned()
    } else {
        "unknown error".to_string()
    };
    Err(err(call, format_args!("error {code}: {text}")))
}

/// Whether MPI is initialised (by kiln or by the application), and finalised.
pub(crate) fn state() -> Result<(bool, bool)> {
    let (mut init, mut fin): (c_int, c_int) = (0, 0);
    // SAFETY: both calls may be made at any time, even before MPI_Init and after MPI_Finalize.
    check(
        unsafe { ffi::MPI_Initialized(&mut init) },
        "MPI_Initialized",
    )?;
    // SAFETY: as above.
    check(unsafe { ffi::MPI_Finalized(&mut fin) }, "MPI_Finalized")?;
    Ok((init != 0, fin != 0))
}

/// `MPI_Init_thread` asking for `MPI_THREAD_MULTIPLE`; the level the library provides.
pub(crate) fn init_thread_multiple() -> Result<bool> {
    let mut provided: c_int = 0;
    // SAFETY: MPI allows null argc/argv; called once, before any other MPI call but the queries.
    check(
        unsafe {
            ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            )
        },
        "MPI_Init_thread",
    )?;
    // SAFETY: reading an immutable constant of the C shim.
    Ok(provided == unsafe { ffi::RSMPI_THREAD_MULTIPLE })
}

/// The thread level of an MPI that someone else initialised.
pub(crate) fn thread_multiple() -> Result<bool> {
    let mut provided: c_int = 0;
    // SAFETY: MPI is initialised (checked by the caller); writes one int.
    check(
        unsafe { ffi::MPI_Query_thread(&mut provided) },
        "MPI_Query_thread",
    )?;
    // SAFETY: reading an immutable constant of the C shim.
    Ok(provided == unsafe { ffi::RSMPI_THREAD_MULTIPLE })
}

pub(crate) fn finalize() -> Result<()> {
    // SAFETY: called once, on the thread that initialised MPI, by the owner of the runtime.
    check(unsafe { ffi::MPI_Finalize() }, "MPI_Finalize")
}

/// This processor's name (the host name under Open MPI and MPICH).
pub(crate) fn processor_name() -> Result<String> {
    let mut name = [0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_PROCESSOR_NAME (256 in Open MPI and MPICH) bytes.
    check(
        unsafe { ffi::MPI_Get_processor_name(name.as_mut_ptr().cast(), &mut len) },
        "MPI_Get_processor_name",
    )?;
    let n = usize::try_from(len).unwrap_or(0).min(name.len());
    Ok(String::from_utf8_lossy(&name[..n]).into_owned())
}

fn to_int(x: usize, what: &str) -> Result<c_int> {
    c_int::try_from(x).map_err(|_| err(what, format_args!("{x} does not fit a C int")))
}

impl CommHandle {
    /// `MPI_COMM_WORLD`.
    pub(crate) fn world() -> CommHandle {
        // SAFETY: converting a predefined handle; MPI is initialised by the caller.
        CommHandle(unsafe { ffi::RSMPI_Comm_c2f(ffi::RSMPI_COMM_WORLD) })
    }

    fn c(self) -> ffi::MPI_Comm {
        // SAFETY: `self.0` came from `MPI_Comm_c2f` of a live communicator.
        unsafe { ffi::RSMPI_Comm_f2c(self.0) }
    }

    fn from_c(c: ffi::MPI_Comm) -> CommHandle {
        // SAFETY: `c` is a live communicator handle.
        CommHandle(unsafe { ffi::RSMPI_Comm_c2f(c) })
    }

    pub(crate) fn rank_and_size(self) -> Result<(usize, usize)> {
        let (mut r, mut n): (c_int, c_int) = (0, 0);
        // SAFETY: a live communicator; each call writes one int.
        check(
            unsafe { ffi::MPI_Comm_rank(self.c(), &mut r) },
            "MPI_Comm_rank",
        )?;
        // SAFETY: as above.
        check(
            unsafe { ffi::MPI_Comm_size(self.c(), &mut n) },
            "MPI_Comm_size",
        )?;
        let r = usize::try_from(r).map_err(|_| err("MPI_Comm_rank", "negative rank"))?;
        let n = usize::try_from(n).map_err(|_| err("MPI_Comm_size", "negative size"))?;
        Ok((r, n))
    }

    /// Makes MPI return error codes on this communicator instead of aborting the job.
    pub(crate) fn errors_return(self) -> Result<()> {
        // SAFETY: a live communicator and a predefined error handler.
        check(
            unsafe { ffi::MPI_Comm_set_errhandler(self.c(), ffi::RSMPI_ERRORS_RETURN) },
            "MPI_Comm_set_errhandler",
        )
    }

    /// Starts `MPI_Comm_idup`; the new handle is written to `out` when the request completes.
    ///
    /// # Safety
    /// `out` must stay valid until the request completes (leak it if the request never does).
    pub(crate) unsafe fn idup(self, out: *mut ffi::MPI_Comm) -> Result<Request> {
        // SAFETY: writing a null request handle; the out-parameter is the caller's.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: a live communicator; `out` is valid per the caller.
        check(
            unsafe { ffi::MPI_Comm_idup(self.c(), out, &mut req) },
            "MPI_Comm_idup",
        )?;
        Ok(req)
    }

    /// Adopts a communicator handle written by a completed [`CommHandle::idup`].
    pub(crate) fn adopt(c: ffi::MPI_Comm) -> CommHandle {
        CommHandle::from_c(c)
    }

    /// `MPI_Comm_split` (blocking: called once every rank is known to have arrived).
    pub(crate) fn split(self, color: u32, key: u32) -> Result<CommHandle> {
        let color = c_int::try_from(color).map_err(|_| {
            err(
                "MPI_Comm_split",
                format_args!("color {color} exceeds a C int"),
            )
        })?;
        let key = c_int::try_from(key)
            .map_err(|_| err("MPI_Comm_split", format_args!("key {key} exceeds a C int")))?;
        // SAFETY: a null handle the call overwrites.
        let mut out = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: a live communicator; `out` is a local written by the call.
        check(
            unsafe { ffi::MPI_Comm_split(self.c(), color, key, &mut out) },
            "MPI_Comm_split",
        )?;
        Ok(CommHandle::from_c(out))
    }

    /// `MPI_Comm_free`.
    pub(crate) fn free(self) -> Result<()> {
        let mut c = self.c();
        // SAFETY: a live communicator owned by the caller, freed once.
        check(unsafe { ffi::MPI_Comm_free(&mut c) }, "MPI_Comm_free")
    }

    /// `MPI_Isend` of bytes.
    ///
    /// # Safety
    /// `buf` must stay valid for reads of `len` bytes until the request completes.
    pub(crate) unsafe fn isend(
        self,
        buf: *const u8,
        len: usize,
        dest: usize,
        tag: i32,
    ) -> Result<Request> {
        // SAFETY: a null request handle the call overwrites.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        let (len, dest) = (to_int(len, "MPI_Isend")?, to_int(dest, "MPI_Isend")?);
        // SAFETY: per the caller; the datatype is predefined.
        check(
            unsafe {
                ffi::MPI_Isend(
                    buf.cast::<c_void>(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    dest,
                    tag,
                    self.c(),
                    &mut req,
                )
            },
            "MPI_Isend",
        )?;
        Ok(req)
    }

    /// `MPI_Irecv` of bytes.
    ///
    /// # Safety
    /// `buf` must stay valid for writes of `len` bytes until the request completes.
    pub(crate) unsafe fn irecv(
        self,
        buf: *mut u8,
        len: usize,
        src: usize,
        tag: i32,
    ) -> Result<Request> {
        // SAFETY: a null request handle the call overwrites.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        let (len, src) = (to_int(len, "MPI_Irecv")?, to_int(src, "MPI_Irecv")?);
        // SAFETY: per the caller; the datatype is predefined.
        check(
            unsafe {
                ffi::MPI_Irecv(
                    buf.cast::<c_void>(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    src,
                    tag,
                    self.c(),
                    &mut req,
                )
            },
            "MPI_Irecv",
        )?;
        Ok(req)
    }

    /// `MPI_Ialltoallv` of bytes; counts and displacements in bytes.
    ///
    /// # Safety
    /// Every buffer and array must stay valid until the request completes; the arrays hold one
    /// entry per rank and the counts fit the buffers.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn ialltoallv(
        self,
        send: *const u8,
        send_counts: *const c_int,
        send_displs: *const c_int,
        recv: *mut u8,
        recv_counts: *const c_int,
        recv_displs: *const c_int,
    ) -> Result<Request> {
        // SAFETY: a null request handle the call overwrites.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: per the caller.
        check(
            unsafe {
                ffi::MPI_Ialltoallv(
                    send.cast::<c_void>(),
                    send_counts,
                    send_displs,
                    ffi::RSMPI_UINT8_T,
                    recv.cast::<c_void>(),
                    recv_counts,
                    recv_displs,
                    ffi::RSMPI_UINT8_T,
                    self.c(),
                    &mut req,
                )
            },
            "MPI_Ialltoallv",
        )?;
        Ok(req)
    }

    /// `MPI_Iallgather` of bytes (`len` from every rank).
    ///
    /// # Safety
    /// As [`CommHandle::ialltoallv`]; `recv` holds `len` bytes per rank.
    pub(crate) unsafe fn iallgather(
        self,
        send: *const u8,
        len: usize,
        recv: *mut u8,
    ) -> Result<Request> {
        // SAFETY: a null request handle the call overwrites.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        let len = to_int(len, "MPI_Iallgather")?;
        // SAFETY: per the caller.
        check(
            unsafe {
                ffi::MPI_Iallgather(
                    send.cast::<c_void>(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    recv.cast::<c_void>(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    self.c(),
                    &mut req,
                )
            },
            "MPI_Iallgather",
        )?;
        Ok(req)
    }

    /// `MPI_Ibcast` of bytes.
    ///
    /// # Safety
    /// `buf` must stay valid for `len` bytes until the request completes.
    pub(crate) unsafe fn ibcast(self, buf: *mut u8, len: usize, root: usize) -> Result<Request> {
        // SAFETY: a null request handle the call overwrites.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        let (len, root) = (to_int(len, "MPI_Ibcast")?, to_int(root, "MPI_Ibcast")?);
        // SAFETY: per the caller.
        check(
            unsafe {
                ffi::MPI_Ibcast(
                    buf.cast::<c_void>(),
                    len,
                    ffi::RSMPI_UINT8_T,
                    root,
                    self.c(),
                    &mut req,
                )
            },
            "MPI_Ibcast",
        )?;
        Ok(req)
    }

    /// `MPI_Ibarrier`.
    pub(crate) fn ibarrier(self) -> Result<Request> {
        // SAFETY: a null request handle the call overwrites.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: a live communicator.
        check(
            unsafe { ffi::MPI_Ibarrier(self.c(), &mut req) },
            "MPI_Ibarrier",
        )?;
        Ok(req)
    }
}

/// A null communicator handle, to be overwritten by MPI.
pub(crate) fn null_comm() -> ffi::MPI_Comm {
    // SAFETY: reading an immutable constant of the C shim.
    unsafe { ffi::RSMPI_COMM_NULL }
}

/// `MPI_Testall`: true when every request has completed (completed ones become null).
pub(crate) fn test_all(reqs: &mut [Request]) -> Result<bool> {
    let mut flag: c_int = 0;
    let n = to_int(reqs.len(), "MPI_Testall")?;
    // SAFETY: `reqs` holds `n` valid (or null) requests; statuses are ignored.
    check(
        unsafe { ffi::MPI_Testall(n, reqs.as_mut_ptr(), &mut flag, ffi::RSMPI_STATUSES_IGNORE) },
        "MPI_Testall",
    )?;
    Ok(flag != 0)
}

/// `MPI_Test` of one request: true when it has completed.
pub(crate) fn test(req: &mut Request) -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: a valid (or null) request; the status is ignored.
    check(
        unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) },
        "MPI_Test",
    )?;
    Ok(flag != 0)
}
