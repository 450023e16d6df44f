//! The launch environment: who am I, how many of us are there, where is the rendezvous store.
//!
//! mtrain follows torchrun's contract, so any launcher that sets these variables (the `mtrain`
//! launcher, torchrun, a Slurm script) can start a job:
//!
//! | variable           | meaning                                              | example     |
//! |--------------------|------------------------------------------------------|-------------|
//! | `RANK`             | global rank of this process, `0..WORLD_SIZE`          | `5`         |
//! | `LOCAL_RANK`       | rank on this node, `0..LOCAL_WORLD_SIZE` (picks a GPU)| `1`         |
//! | `WORLD_SIZE`       | number of processes in the job                       | `8`         |
//! | `LOCAL_WORLD_SIZE` | number of processes on this node                     | `4`         |
//! | `MASTER_ADDR`      | host of rank 0, which serves the rendezvous store     | `127.0.0.1` |
//! | `MASTER_PORT`      | port of the rendezvous store                          | `29500`     |
//! | `MTRAIN_JOB_ID`    | optional; processes of other jobs are turned away     | `run-42`    |
//! | `MTRAIN_STORE_EXTERNAL` | `1`: the launcher already serves the store, rank 0 does not | `1` |
//! | `MTRAIN_STORE_PORT` | optional; the port of mtrain's store, instead of the rule below | `29501` |
//!
//! `RANK` unset means "not launched": the process runs alone ([`LaunchEnv::single`]).
//!
//! **Where mtrain's rendezvous store lives.** Under the mtrain launcher, Slurm or a shell loop,
//! at `MASTER_ADDR:MASTER_PORT`, served by rank 0 (or by the launcher, `MTRAIN_STORE_EXTERNAL`).
//! torchrun is different: its agent on the first node already serves its own c10d `TCPStore` on
//! `MASTER_PORT` and tells the workers so with `TORCHELASTIC_USE_AGENT_STORE=True` (PyTorch's
//! `env://` init then only connects). mtrain does not speak that store's protocol, so under that
//! variable rank 0 serves mtrain's store on the next port, `MASTER_PORT + 1`, on the same host
//! (torchrun sets `MASTER_ADDR` to the host of global rank 0). Every rank applies the same rule
//! to the same variables, so all of them meet there; `MTRAIN_STORE_PORT` replaces the rule
//! when that port is taken. Under torchrun the job id is `TORCHELASTIC_RUN_ID` with the restart
//! count, so a worker left over from an earlier attempt is turned away by the store.

use crate::communicator::{CommError, Result};

/// Job id used when neither `MTRAIN_JOB_ID` nor torchrun's `TORCHELASTIC_RUN_ID` is set.
pub const DEFAULT_JOB_ID: &str = "mtrain";
/// Set to `True` by torchrun when its agent serves a c10d store on `MASTER_PORT`.
pub const TORCHRUN_AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// Explicit port of mtrain's rendezvous store (overrides the rule of the module doc).
pub const STORE_PORT_VAR: &str = "MTRAIN_STORE_PORT";

/// Where this process stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Port of mtrain's rendezvous store on `master_addr`: `master_port`, except under
    /// torchrun's agent store (see the module doc) or with `MTRAIN_STORE_PORT`.
    pub store_port: u16,
    pub job_id: String,
    /// The rendezvous store is served by someone else (the `mtrain` launcher, which binds its
    /// port before starting the workers so no other process can take it); rank 0 only connects.
    pub store_external: bool,
}

impl LaunchEnv {
    /// A one-process job: rank 0 of 1, store on loopback (never started for a single rank).
    pub fn single() -> Self {
        Self {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: 0,
            store_port: 0,
            job_id: DEFAULT_JOB_ID.to_string(),
            store_external: false,
        }
    }

    /// Read the torchrun variables from the process environment. `Ok(None)` when `RANK` is unset.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Like [`LaunchEnv::from_env`], reading variables through `get` (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some(rank) = get("RANK") else {
            return Ok(None);
        };
        let rank = parse_num::<usize>("RANK", &rank)?;
        let required = |name: &str| -> Result<String> {
            get(name).ok_or_else(|| {
                CommError::Env(format!("RANK is set ({rank}) but {name} is missing; a launcher must set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT"))
            })
        };
        let local_rank = parse_num::<usize>("LOCAL_RANK", &required("LOCAL_RANK")?)?;
        let world_size = parse_num::<usize>("WORLD_SIZE", &required("WORLD_SIZE")?)?;
        let local_world_size =
            parse_num::<usize>("LOCAL_WORLD_SIZE", &required("LOCAL_WORLD_SIZE")?)?;
        let master_addr = required("MASTER_ADDR")?.trim().to_string();
        let master_port = parse_num::<u16>("MASTER_PORT", &required("MASTER_PORT")?)?;
        let torchrun_store = get(TORCHRUN_AGENT_STORE_VAR).is_some_and(|v| v.trim() == "True");
        let store_port = match get(STORE_PORT_VAR) {
            Some(p) => parse_num::<u16>(STORE_PORT_VAR, &p)?,
            None if torchrun_store => master_port.checked_add(1).ok_or_else(|| {
                CommError::Env(format!(
                    "MASTER_PORT={master_port} is torchrun's own store ({TORCHRUN_AGENT_STORE_VAR}=True) and mtrain's store would go on the next port, which does not exist; set {STORE_PORT_VAR}"
                ))
            })?,
            None => master_port,
        };
        let job_id = match (get("MTRAIN_JOB_ID"), get("TORCHELASTIC_RUN_ID")) {
            (Some(id), _) => id,
            (None, Some(run)) => {
                let restart = get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
                format!("torchelastic-{run}-{restart}")
            }
            (None, None) => DEFAULT_JOB_ID.to_string(),
        };
        let store_external = get("MTRAIN_STORE_EXTERNAL").is_some_and(|v| v == "1");
        let env = Self {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
            store_port,
            job_id,
            store_external,
        };
        env.validate()?;
        Ok(Some(env))
    }

    /// Check that the numbers fit together.
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(CommError::Env(
                "WORLD_SIZE must be at least 1, got 0".into(),
            ));
        }
        if self.rank >= self.world_size {
            return Err(CommError::Env(format!(
                "RANK={} is out of range for WORLD_SIZE={} (ranks are 0..{})",
                self.rank, self.world_size, self.world_size
            )));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return Err(CommError::Env(format!(
                "LOCAL_WORLD_SIZE={} must be in 1..={} (WORLD_SIZE)",
                self.local_world_size, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(CommError::Env(format!(
                "LOCAL_RANK={} is out of range for LOCAL_WORLD_SIZE={}",
                self.local_rank, self.local_world_size
            )));
        }
        if self.master_addr.is_empty() {
            return Err(CommError::Env("MASTER_ADDR is empty".into()));
        }
        if self.world_size > 1 && (self.master_port == 0 || self.store_port == 0) {
            return Err(CommError::Env(format!(
                "MASTER_PORT (and {STORE_PORT_VAR}) must be a real port for a job of {} ranks, got 0",
                self.world_size
            )));
        }
        Ok(())
    }

    /// Why the store is on `store_port`, for error messages: which rule of the module doc chose it.
    pub fn store_port_rule(&self) -> String {
        if self.store_port == self.master_port {
            format!("the store's port is MASTER_PORT={}; {STORE_PORT_VAR} chooses another", self.master_port)
        } else {
            format!(
                "the store's port is {} and not MASTER_PORT={} (torchrun's own store holds that one, {TORCHRUN_AGENT_STORE_VAR}=True, or {STORE_PORT_VAR} was set); {STORE_PORT_VAR} chooses another",
                self.store_port, self.master_port
            )
        }
    }

    /// Where mtrain's rendezvous store is: `MASTER_ADDR:store_port` (`MASTER_PORT` unless
    /// under torchrun's agent store, see the module doc), bracketing IPv6 literals.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.store_port)
        } else {
            format!("{}:{}", self.master_addr, self.store_port)
        }
    }
}

fn parse_num<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse::<T>().map_err(|_| {
        CommError::Env(format!(
            "{name}={value:?} is not a valid {}",
            std::any::type_name::<T>()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const FULL: [(&str, &str); 6] = [
        ("RANK", "3"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn unset_rank_means_not_launched() {
        assert_eq!(LaunchEnv::from_vars(vars(&[])).unwrap(), None);
    }

    #[test]
    fn reads_every_variable() {
        let env = LaunchEnv::from_vars(vars(&FULL)).unwrap().unwrap();
        assert_eq!(
            (
                env.rank,
                env.local_rank,
                env.world_size,
                env.local_world_size
            ),
            (3, 1, 4, 2)
        );
        assert_eq!(env.store_addr(), "10.0.0.1:29500");
        assert_eq!(env.job_id, DEFAULT_JOB_ID);
    }

    #[test]
    fn under_torchruns_agent_store_the_store_is_on_the_next_port() {
        let mut torchrun = FULL.to_vec();
        torchrun.extend([
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        let env = LaunchEnv::from_vars(vars(&torchrun)).unwrap().unwrap();
        assert_eq!((env.master_port, env.store_port), (29500, 29501));
        assert_eq!(env.store_addr(), "10.0.0.1:29501");
        assert_eq!(env.job_id, "torchelastic-none-2");
        // An explicit port wins; without the agent store MASTER_PORT is mtrain's.
        torchrun.push(("MTRAIN_STORE_PORT", "31000"));
        let env = LaunchEnv::from_vars(vars(&torchrun)).unwrap().unwrap();
        assert_eq!(env.store_addr(), "10.0.0.1:31000");
        let mut own = FULL.to_vec();
        own.push(("TORCHELASTIC_USE_AGENT_STORE", "False"));
        let env = LaunchEnv::from_vars(vars(&own)).unwrap().unwrap();
        assert_eq!(env.store_addr(), "10.0.0.1:29500");
        let mut last = FULL.to_vec();
        last[5] = ("MASTER_PORT", "65535");
        last.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        let err = LaunchEnv::from_vars(vars(&last)).unwrap_err().to_string();
        assert!(err.contains("MTRAIN_STORE_PORT"), "{err}");
    }

    #[test]
    fn names_the_bad_variable() {
        let mut bad = FULL.to_vec();
        bad[5] = ("MASTER_PORT", "eighty");
        let err = LaunchEnv::from_vars(vars(&bad)).unwrap_err().to_string();
        assert!(err.contains("MASTER_PORT=\"eighty\""), "{err}");
        let missing: Vec<_> = FULL
            .iter()
            .copied()
            .filter(|(k, _)| *k != "WORLD_SIZE")
            .collect();
        let err = LaunchEnv::from_vars(vars(&missing))
            .unwrap_err()
            .to_string();
        assert!(err.contains("WORLD_SIZE is missing"), "{err}");
        let mut out_of_range = FULL.to_vec();
        out_of_range[0] = ("RANK", "4");
        let err = LaunchEnv::from_vars(vars(&out_of_range))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RANK=4") && err.contains("WORLD_SIZE=4"),
            "{err}"
        );
    }
}
