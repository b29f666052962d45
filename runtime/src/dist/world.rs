//! Which rank this process is, read from the variables a launcher sets: torchrun, srun
//! (SLURM), OpenMPI's mpirun, MPICH's mpiexec. The reading is a pure function of a variable
//! lookup so that every launcher's conventions are unit-tested without touching the process
//! environment. It must not connect to anything: `Store` and `ProcessGroup` do that.

use super::{DistError, Result};

/// The launcher whose variables described the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (or anything that sets `RANK` and `WORLD_SIZE`).
    Torchrun,
    /// OpenMPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH's (or Intel MPI's) `mpiexec` (`PMI_RANK`, `PMI_SIZE`).
    Mpich,
    /// SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`).
    Slurm,
    /// No launcher: one process, rank 0 of 1.
    Single,
}

/// This process's place in an SPMD job of one process per device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// The number of processes.
    pub size: usize,
    /// The rank among the processes on this node (which device to use).
    pub local_rank: usize,
    /// The number of processes on this node, when the launcher says.
    pub local_size: Option<usize>,
    /// This node's index, when the launcher says.
    pub node: Option<usize>,
    /// Host and port of the TCP store, which rank 0 hosts. Known for every world of more than
    /// one process; `None` only for a single process.
    pub master: Option<(String, u16)>,
    /// Whose variables these were.
    pub launcher: Launcher,
}

impl World {
    /// One process, rank 0 of 1, with no store address.
    pub fn single() -> World {
        World {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: Some(1),
            node: Some(0),
            master: None,
            launcher: Launcher::Single,
        }
    }

    /// Reads the process environment (see [`World::from_vars`]).
    pub fn from_env() -> Result<World> {
        World::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads a launcher's variables through `var`. The first launcher whose rank variable is
    /// set wins, in this order: torchrun, OpenMPI, MPICH, SLURM. SLURM is last because
    /// `mpirun` and torchrun are often started inside a SLURM step, whose `SLURM_PROCID`
    /// then describes the step, not these processes. No variable at all is a single process.
    ///
    /// The store's address is `MASTER_ADDR`/`MASTER_PORT`, as for torch's `env://`; under
    /// SLURM, `MASTER_ADDR` defaults to the first host of `SLURM_JOB_NODELIST`. A world of more
    /// than one process without both is an error (there is no default port: two jobs on one
    /// node would meet on it), as is any rank outside its size.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<World> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let world = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            let (rank, size) = (required(&var, "RANK")?, required(&var, "WORLD_SIZE")?);
            World {
                rank,
                size,
                local_rank: optional(&var, "LOCAL_RANK")?.unwrap_or(0),
                local_size: optional(&var, "LOCAL_WORLD_SIZE")?,
                node: optional(&var, "GROUP_RANK")?,
                master: master(&var, size, Launcher::Torchrun)?,
                launcher: Launcher::Torchrun,
            }
        } else if var("OMPI_COMM_WORLD_RANK").is_some() {
            let size = required(&var, "OMPI_COMM_WORLD_SIZE")?;
            World {
                rank: required(&var, "OMPI_COMM_WORLD_RANK")?,
                size,
                local_rank: required(&var, "OMPI_COMM_WORLD_LOCAL_RANK")?,
                local_size: optional(&var, "OMPI_COMM_WORLD_LOCAL_SIZE")?,
                node: optional(&var, "OMPI_COMM_WORLD_NODE_RANK")?,
                master: master(&var, size, Launcher::OpenMpi)?,
                launcher: Launcher::OpenMpi,
            }
        } else if var("PMI_RANK").is_some() {
            let size = required(&var, "PMI_SIZE")?;
            World {
                rank: required(&var, "PMI_RANK")?,
                size,
                local_rank: optional(&var, "MPI_LOCALRANKID")?.unwrap_or(0),
                local_size: optional(&var, "MPI_LOCALNRANKS")?,
                node: None,
                master: master(&var, size, Launcher::Mpich)?,
                launcher: Launcher::Mpich,
            }
        } else if var("SLURM_PROCID").is_some() {
            let size = required(&var, "SLURM_NTASKS")?;
            World {
                rank: required(&var, "SLURM_PROCID")?,
                size,
                local_rank: required(&var, "SLURM_LOCALID")?,
                local_size: None,
                node: optional(&var, "SLURM_NODEID")?,
                master: master(&var, size, Launcher::Slurm)?,
                launcher: Launcher::Slurm,
            }
        } else {
            return Ok(World::single());
        };
        world.check()?;
        Ok(world)
    }

    fn check(&self) -> Result<()> {
        let launcher = self.launcher;
        if self.size == 0 {
            return Err(env_error(format!("{launcher:?}: the world size is 0")));
        }
        if self.rank >= self.size {
            return Err(env_error(format!(
                "{launcher:?}: rank {} is not below the world size {}",
                self.rank, self.size
            )));
        }
        if let Some(local_size) = self.local_size {
            if self.local_rank >= local_size {
                return Err(env_error(format!(
                    "{launcher:?}: local rank {} is not below the local size {local_size}",
                    self.local_rank
                )));
            }
            if local_size > self.size {
                return Err(env_error(format!(
                    "{launcher:?}: local size {local_size} exceeds the world size {}",
                    self.size
                )));
            }
        }
        if self.local_rank >= self.size {
            return Err(env_error(format!(
                "{launcher:?}: local rank {} is not below the world size {}",
                self.local_rank, self.size
            )));
        }
        Ok(())
    }
}

fn env_error(what: String) -> DistError {
    DistError::Environment(what)
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| {
        env_error(format!(
            "{name}={value:?} is not a non-negative integer in range"
        ))
    })
}

fn required(var: &impl Fn(&str) -> Option<String>, name: &str) -> Result<usize> {
    match var(name) {
        Some(value) => parse(name, &value),
        None => Err(env_error(format!("{name} is not set"))),
    }
}

fn optional(var: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    var(name).map(|value| parse(name, &value)).transpose()
}

fn master(
    var: &impl Fn(&str) -> Option<String>,
    size: usize,
    launcher: Launcher,
) -> Result<Option<(String, u16)>> {
    let addr = match var("MASTER_ADDR") {
        Some(addr) => Some(addr.trim().to_owned()),
        None if launcher == Launcher::Slurm => var("SLURM_JOB_NODELIST")
            .or_else(|| var("SLURM_NODELIST"))
            .map(|list| first_host(&list))
            .transpose()?,
        None => None,
    };
    let port = var("MASTER_PORT")
        .map(|port| parse::<u16>("MASTER_PORT", &port))
        .transpose()?;
    match (addr, port) {
        (Some(addr), Some(port)) => Ok(Some((addr, port))),
        _ if size <= 1 => Ok(None),
        (None, _) => Err(env_error(format!(
            "{launcher:?}: a world of {size} processes needs the store host rank 0 runs on: set \
             MASTER_ADDR{}",
            if launcher == Launcher::Slurm {
                " (or SLURM_JOB_NODELIST)"
            } else {
                ""
            }
        ))),
        (Some(_), None) => Err(env_error(format!(
            "{launcher:?}: a world of {size} processes needs MASTER_PORT, the store's port on rank \
             0's host (torchrun sets it; export it for srun or mpirun)"
        ))),
    }
}

/// The first host of a SLURM host list: `node[03-05,9],gpu1` → `node03`, `a[1-2]-b[7-8]` →
/// `a1-b7`. Zero padding is kept, as SLURM writes it.
pub fn first_host(list: &str) -> Result<String> {
    let bad = || env_error(format!("SLURM_JOB_NODELIST={list:?} is not a host list"));
    let mut host = String::new();
    let mut chars = list.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let mut range = String::new();
                for c in chars.by_ref() {
                    if c == ']' {
                        break;
                    }
                    range.push(c);
                }
                let first = range
                    .split(',')
                    .next()
                    .and_then(|item| item.split('-').next())
                    .map(str::trim)
                    .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
                    .ok_or_else(bad)?;
                host.push_str(first);
            }
            ']' => return Err(bad()),
            c => host.push(c),
        }
    }
    if host.is_empty() {
        return Err(bad());
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn world(vars: &[(&str, &str)]) -> Result<World> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|name| vars.get(name).cloned())
    }

    fn error(vars: &[(&str, &str)]) -> String {
        match world(vars) {
            Ok(w) => panic!("expected an error, got {w:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn torchrun() {
        let w = world(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .expect("torchrun world");
        assert_eq!(
            w,
            World {
                rank: 3,
                size: 8,
                local_rank: 1,
                local_size: Some(2),
                node: Some(1),
                master: Some(("node0".into(), 1234)),
                launcher: Launcher::Torchrun,
            }
        );
    }

    #[test]
    fn slurm_takes_the_first_host_of_the_node_list() {
        let w = world(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_JOB_NODELIST", "gpu[007-010,12],cpu1"),
            ("MASTER_PORT", "29400"),
        ])
        .expect("slurm world");
        assert_eq!((w.rank, w.size, w.local_rank, w.node), (5, 8, 1, Some(2)));
        assert_eq!(w.master, Some(("gpu007".into(), 29400)));
        assert_eq!(w.launcher, Launcher::Slurm);
    }

    #[test]
    fn slurm_master_addr_wins_over_the_node_list() {
        let w = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "a[1-2]"),
            ("MASTER_ADDR", "10.0.0.9"),
            ("MASTER_PORT", "29500"),
        ])
        .expect("slurm world");
        assert_eq!(w.master, Some(("10.0.0.9".into(), 29500)));
    }

    #[test]
    fn openmpi_and_mpich() {
        let w = world(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            // mpirun inside a SLURM step: the step's variables describe another job.
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
        ])
        .expect("openmpi world");
        assert_eq!((w.rank, w.size, w.local_size), (2, 4, Some(2)));
        assert_eq!(w.launcher, Launcher::OpenMpi);
        assert_eq!(w.master, Some(("h".into(), 29500)));

        let w = world(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "7"),
        ])
        .expect("mpich world");
        assert_eq!((w.rank, w.size, w.local_rank), (1, 2, 1));
        assert_eq!(w.launcher, Launcher::Mpich);
    }

    #[test]
    fn no_launcher_is_a_single_process() {
        assert_eq!(world(&[]).expect("single"), World::single());
        let w = world(&[("RANK", "0"), ("WORLD_SIZE", "1")]).expect("single torchrun");
        assert_eq!((w.size, w.master.clone()), (1, None));
    }

    #[test]
    fn inconsistent_variables_are_errors_that_name_them() {
        let e = error(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(e.contains("rank 4 is not below the world size 4"), "{e}");
        let e = error(&[("RANK", "0")]);
        assert!(e.contains("WORLD_SIZE is not set"), "{e}");
        let e = error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]);
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = error(&[("RANK", "-1"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK=\"-1\""), "{e}");
        let e = error(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ]);
        assert!(e.contains("MASTER_PORT=\"70000\""), "{e}");
        let e = error(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(e.contains("SLURM_JOB_NODELIST"), "{e}");
        let e = error(&[("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = error(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(
            e.contains("local rank 3 is not below the local size 2"),
            "{e}"
        );
        let e = error(&[("WORLD_SIZE", "0"), ("RANK", "0")]);
        assert!(e.contains("world size is 0"), "{e}");
    }

    #[test]
    fn slurm_host_lists() {
        assert_eq!(first_host("n1").expect("plain"), "n1");
        assert_eq!(first_host("n1,n2").expect("list"), "n1");
        assert_eq!(first_host("n[08-11]").expect("range"), "n08");
        assert_eq!(first_host("n[3,5-6],m1").expect("mixed"), "n3");
        assert_eq!(
            first_host("rack[2-3]-node[01-04]").expect("2d"),
            "rack2-node01"
        );
        assert!(first_host("n[x]").is_err());
        assert!(first_host("").is_err());
        assert!(first_host("n]").is_err());
    }
}
