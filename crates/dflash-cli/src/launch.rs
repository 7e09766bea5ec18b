//! `train --gpus N` and `data generate --gpus N`: one process per GPU, as torchrun starts them. The launcher (the process
//! the person started) re-runs this binary with the same arguments once per local GPU, with
//! the rank in the environment; each rank joins the NCCL group (its id handed out by global
//! rank 0 over `--rendezvous`) and trains its slice of every step. If a rank fails, the
//! launcher stops the others and exits non-zero naming it.

use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Where a rank process is in its group (from the launcher's environment).
#[derive(Debug, Clone)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub rendezvous: String,
}

/// The group the launcher starts: `gpus` per node on `nnodes` nodes, this node's number.
#[derive(Debug, Clone)]
pub struct Launch {
    pub gpus: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub rendezvous: String,
}

impl Launch {
    pub fn world(&self) -> usize {
        self.gpus * self.nnodes
    }

    /// Refuse a group that cannot exist, by name.
    pub fn check(&self) -> Result<()> {
        if self.nnodes == 0 || self.node_rank >= self.nnodes {
            bail!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank,
                self.nnodes
            );
        }
        if !self.rendezvous.contains(':') {
            bail!("--rendezvous must be HOST:PORT (got '{}')", self.rendezvous);
        }
        Ok(())
    }
}

/// This process's rank, when a launcher started it.
pub fn rank_env() -> Result<Option<RankEnv>> {
    use dflash_core::env::{LOCAL_RANK, RANK, RENDEZVOUS, WORLD};
    let Some(rank) = RANK.get() else {
        return Ok(None);
    };
    let num = |v: &dflash_core::env::Var| -> Result<usize> {
        v.get()
            .with_context(|| format!("{} is not set ({} is)", v.name, RANK.name))?
            .parse()
            .with_context(|| format!("{} is not a number", v.name))
    };
    Ok(Some(RankEnv {
        rank: rank
            .parse()
            .with_context(|| format!("{} is not a number", RANK.name))?,
        world: num(&WORLD)?,
        local_rank: num(&LOCAL_RANK)?,
        rendezvous: RENDEZVOUS
            .get()
            .with_context(|| format!("{} is not set", RENDEZVOUS.name))?,
    }))
}

/// Start this node's ranks and wait for them; the first that fails stops the rest.
pub fn launch(l: &Launch) -> Result<()> {
    let exe = std::env::current_exe().context("the path of this binary")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    eprintln!(
        "launching {} rank(s) on this node ({} in all), rendezvous {}",
        l.gpus,
        l.world(),
        l.rendezvous
    );
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..l.gpus {
        let rank = l.node_rank * l.gpus + local;
        let child = Command::new(&exe)
            .args(&args)
            .env(dflash_core::env::RANK.name, rank.to_string())
            .env(dflash_core::env::WORLD.name, l.world().to_string())
            .env(dflash_core::env::LOCAL_RANK.name, local.to_string())
            .env(dflash_core::env::RENDEZVOUS.name, &l.rendezvous)
            // NVLink multicast (NVLS) off: not every machine's fabric manager allows it
            .env("NCCL_NVLS_ENABLE", "0")
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push((rank, child));
    }
    let mut running = children.len();
    while running > 0 {
        running = 0;
        for i in 0..children.len() {
            let (rank, child) = &mut children[i];
            match child.try_wait()? {
                Some(st) if !st.success() => {
                    let rank = *rank;
                    for (_, c) in children.iter_mut() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    bail!("rank {rank} exited with {st}: the other ranks were stopped");
                }
                Some(_) => {}
                None => running += 1,
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// The collective of a launched rank: NCCL on its GPU (`cuda:LOCAL_RANK`), the group's id
/// from global rank 0.
#[cfg(feature = "cuda")]
pub fn nccl_rank(
    env: &RankEnv,
    device: &candle_core::Device,
) -> Result<dflash_train::collective::nccl::NcclRank> {
    use dflash_train::collective::{nccl, rendezvous};
    let wait = Duration::from_secs(300);
    let id = if env.rank == 0 {
        let id = nccl::unique_id()?;
        let (addr, world) = (env.rendezvous.clone(), env.world);
        std::thread::spawn(move || {
            if let Err(e) = rendezvous::serve(&addr, &id, world, wait) {
                eprintln!("rank 0: {e:#}");
            }
        });
        id
    } else {
        rendezvous::fetch(&env.rendezvous, wait)?
    };
    nccl::NcclRank::new(device, env.rank, env.world, id)
}
