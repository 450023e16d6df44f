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
//!
//! `RANK` unset means "not launched": the process runs alone ([`LaunchEnv::single`]).

use crate::communicator::{CommError, Result};

/// Job id used when `MTRAIN_JOB_ID` is not set.
pub const DEFAULT_JOB_ID: &str = "mtrain";

/// Where this process stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
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
        let job_id = get("MTRAIN_JOB_ID").unwrap_or_else(|| DEFAULT_JOB_ID.to_string());
        let store_external = get("MTRAIN_STORE_EXTERNAL").is_some_and(|v| v == "1");
        let env = Self {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
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
        if self.world_size > 1 && self.master_port == 0 {
            return Err(CommError::Env(format!(
                "MASTER_PORT must be a real port for a job of {} ranks, got 0",
                self.world_size
            )));
        }
        Ok(())
    }

    /// `MASTER_ADDR:MASTER_PORT`, bracketing IPv6 literals.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
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
