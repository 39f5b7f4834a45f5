//! The token a job's rendezvous store asks of every client, so that it admits only the
//! processes of its own job: a stale rank of an earlier run on the same port, or another job's
//! process that was given the wrong `MASTER_PORT`, is refused and named instead of joining.

use crate::error::{LaunchError, Result};
use std::fmt;
use std::io::Read;

/// The variable a launcher passes the job's token to its processes in (`kiln launch` sets it to
/// a random token for the processes of one node).
pub const STORE_TOKEN_VAR: &str = "KILN_STORE_TOKEN";

/// Variables that name a job, in order of precedence: torchrun's run id, Slurm's job id, and
/// the PMIx namespace Open MPI's mpirun gives each job.
const JOB_ID_VARS: [&str; 3] = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE"];

/// The secret every client of a rendezvous store presents, and where it came from (for the
/// error that refuses a wrong one). Its [`fmt::Debug`] leaves the secret out.
///
/// ```
/// use kiln_launch::StoreToken;
/// let given = StoreToken::new("s3cret", "--store-token");
/// assert_eq!((given.value(), given.source()), ("s3cret", "--store-token"));
/// // derived from the job: the same job gives every rank the same token, another job another
/// let job = |id: &'static str| {
///     move |k: &str| match k {
///         "SLURM_JOB_ID" => Some(id.to_string()),
///         "MASTER_ADDR" => Some("node01".to_string()),
///         "MASTER_PORT" => Some("29500".to_string()),
///         _ => None,
///     }
/// };
/// assert_eq!(StoreToken::from_vars(job("41")), StoreToken::from_vars(job("41")));
/// assert_ne!(StoreToken::from_vars(job("41")), StoreToken::from_vars(job("42")));
/// assert!(!format!("{given:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct StoreToken {
    secret: String,
    source: String,
}

impl StoreToken {
    /// A token given explicitly; `source` says where from (a flag, a variable, a file).
    pub fn new(secret: impl Into<String>, source: impl Into<String>) -> StoreToken {
        StoreToken {
            secret: secret.into(),
            source: source.into(),
        }
    }

    /// A fresh random token (128 bits from `/dev/urandom`), for a launcher to hand to the
    /// processes it starts in [`STORE_TOKEN_VAR`].
    pub fn random() -> Result<StoreToken> {
        let mut bytes = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(|e| LaunchError::Env {
                variable: STORE_TOKEN_VAR.into(),
                message: format!("cannot draw a random token from /dev/urandom: {e}"),
            })?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(StoreToken::new(hex, "a random token of the launcher"))
    }

    /// The job's token from its variables: [`STORE_TOKEN_VAR`] when set; otherwise derived
    /// from the job's id (`TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`, or Open MPI's
    /// `PMIX_NAMESPACE`, the first one set) and `MASTER_ADDR:MASTER_PORT`, which every
    /// process of one job reads alike; with no job id, from `MASTER_ADDR:MASTER_PORT` alone.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> StoreToken {
        let get = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        if let Some(t) = get(STORE_TOKEN_VAR) {
            return StoreToken::new(t, STORE_TOKEN_VAR);
        }
        let master = format!(
            "{}:{}",
            get("MASTER_ADDR").unwrap_or_default(),
            get("MASTER_PORT").unwrap_or_default()
        );
        match JOB_ID_VARS.iter().find_map(|k| get(k).map(|v| (*k, v))) {
            Some((var, id)) => StoreToken::new(
                format!("kiln-store/{var}={id}/{master}"),
                format!("{var}, MASTER_ADDR and MASTER_PORT"),
            ),
            None => StoreToken::new(
                format!("kiln-store/{master}"),
                "MASTER_ADDR and MASTER_PORT (no job id variable is set)",
            ),
        }
    }

    /// The secret, as a launcher passes it on in [`STORE_TOKEN_VAR`].
    pub fn value(&self) -> &str {
        &self.secret
    }

    /// Where the token came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Compares `presented` with the secret in time independent of where they differ.
    pub(crate) fn admits(&self, presented: &[u8]) -> bool {
        let mine = self.secret.as_bytes();
        mine.len() == presented.len()
            && mine
                .iter()
                .zip(presented)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl fmt::Debug for StoreToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreToken")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> StoreToken {
        StoreToken::from_vars(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn a_given_token_wins_then_the_job_id_then_the_master() {
        let given = from(&[(STORE_TOKEN_VAR, "abc"), ("SLURM_JOB_ID", "7")]);
        assert_eq!((given.value(), given.source()), ("abc", STORE_TOKEN_VAR));
        let torch = from(&[
            ("TORCHELASTIC_RUN_ID", "run1"),
            ("SLURM_JOB_ID", "7"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        assert_eq!(torch.value(), "kiln-store/TORCHELASTIC_RUN_ID=run1/h:1");
        assert!(torch.source().starts_with("TORCHELASTIC_RUN_ID"));
        let mpi = from(&[("PMIX_NAMESPACE", "prterun-x-1@1"), ("MASTER_ADDR", "h")]);
        assert_eq!(mpi.value(), "kiln-store/PMIX_NAMESPACE=prterun-x-1@1/h:");
        let bare = from(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "29500")]);
        assert_eq!(bare.value(), "kiln-store/h:29500");
        // another port is another job
        assert_ne!(
            bare,
            from(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "29501")])
        );
    }

    #[test]
    fn admits_only_the_same_bytes() {
        let t = StoreToken::new("secret", "test");
        assert!(t.admits(b"secret"));
        for other in [&b"secreT"[..], b"secret ", b"secre", b""] {
            assert!(!t.admits(other), "{other:?}");
        }
        let r = StoreToken::random().unwrap();
        assert_eq!(r.value().len(), 32);
        assert_ne!(r, StoreToken::random().unwrap());
    }
}
