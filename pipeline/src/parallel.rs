//! A streaming session across cards (DESIGN.md §5): an [`EngineGroup`] runs one [`Engine`] per
//! rank on its own thread. Every rank replays the same session (same seed, controls, prompt),
//! so noise, camera and sampler agree everywhere; the DiT runs on the rank's token shard with
//! Ulysses self-attention and a KV cache of the rank's heads; rank 0's chunk is the result.

use std::sync::Arc;
use std::time::Duration;

use kernels::{Device, Tensor};
use sp::{
    BoxError, CommStats, Communicator, LoopbackWorld, NcclComm, RankGroup, RankWorker, RcclComm,
};

use crate::{Chunk, ChunkInputs, Edit, Engine, EngineConfig, Error, ModelConfig, Result, WanModel};

/// How long a rank may wait in a collective for the others before the group fails, and how
/// long the others may take to stop once one rank has failed.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(600);

/// What the group's ranks are asked to do, each on its own engine.
#[derive(Clone, Debug)]
enum Job {
    Chunk(ChunkInputs),
    Edit(ChunkInputs, Edit),
    Prompt(Tensor),
    FirstFrame(Tensor),
    Reset,
    ResendWindow(bool),
}

#[derive(Debug)]
struct RankEngine {
    engine: Engine,
    rank: usize,
}

impl RankWorker<Job> for RankEngine {
    type Output = Option<Chunk>;

    fn run(&mut self, job: Job) -> std::result::Result<Option<Option<Chunk>>, BoxError> {
        let chunk = match job {
            Job::Chunk(inputs) => Some(self.engine.next_chunk(&inputs)?),
            Job::Edit(inputs, edit) => Some(self.engine.next_chunk_edit(&inputs, &edit)?),
            Job::Prompt(context) => {
                self.engine.set_prompt(&context)?;
                None
            }
            Job::FirstFrame(latent) => {
                self.engine.set_first_frame(&latent)?;
                None
            }
            Job::Reset => {
                self.engine.reset();
                None
            }
            Job::ResendWindow(on) => {
                self.engine.set_resend_window(on);
                None
            }
        };
        Ok((self.rank == 0).then_some(chunk))
    }
}

/// Wraps each rank's communicator before its engine is built (tracing, fault injection).
pub type CommWrapper = dyn Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Send + Sync;

/// Builds one rank's model on the given device (e.g. a `WeightStore` opened again and put
/// `on_device`, then `WanModel::load`).
pub type ModelLoader = dyn Fn(Device) -> Result<WanModel> + Send + Sync;

/// One streaming session on `cards` ranks, in lockstep.
#[derive(Debug)]
pub struct EngineGroup {
    group: RankGroup<Job, Option<Chunk>>,
}

impl EngineGroup {
    /// `cards` ranks as threads of this process over the loopback communicator, all sharing
    /// `model` (the weights are not sharded). The model's heads must divide by `cards`.
    pub fn loopback(model: Arc<WanModel>, cfg: EngineConfig, cards: usize) -> Result<Self> {
        Self::loopback_with(model, cfg, cards, Arc::new(|c| c))
    }

    /// [`loopback`](Self::loopback) with each rank's communicator passed through `wrap`.
    pub fn loopback_with(
        model: Arc<WanModel>,
        cfg: EngineConfig,
        cards: usize,
        wrap: Arc<CommWrapper>,
    ) -> Result<Self> {
        sp::heads_per_card(model.cfg.num_heads, cards)?;
        let comms = LoopbackWorld::new(cards, COLLECTIVE_TIMEOUT)?
            .communicators()
            .into_iter()
            .map(|c| wrap(Arc::new(c)))
            .collect();
        let group = RankGroup::spawn(comms, COLLECTIVE_TIMEOUT, move |rank, comm| {
            let engine = Engine::with_communicator(model.clone(), cfg.clone(), comm)?;
            Ok(RankEngine { engine, rank })
        })?;
        Ok(EngineGroup { group })
    }

    /// One rank per GPU of `gpus` (rank `i` on `cuda:gpus[i]`) over NCCL: each rank loads its
    /// own copy of the model onto its GPU with `load` (on its own thread, so the copies load
    /// in parallel), then runs the same lockstep engine as [`loopback`](Self::loopback).
    /// `model`'s heads must divide by the GPU count.
    pub fn nccl(
        model: &ModelConfig,
        load: Arc<ModelLoader>,
        cfg: EngineConfig,
        gpus: &[usize],
    ) -> Result<Self> {
        Self::nccl_with(model, load, cfg, gpus, COLLECTIVE_TIMEOUT)
    }

    /// [`nccl`](Self::nccl) with another bound on how long a rank waits for a collective (and
    /// for the others to join the group).
    pub fn nccl_with(
        model: &ModelConfig,
        load: Arc<ModelLoader>,
        cfg: EngineConfig,
        gpus: &[usize],
        timeout: Duration,
    ) -> Result<Self> {
        sp::heads_per_card(model.num_heads, gpus.len())?;
        let comms = NcclComm::group(gpus, timeout)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        Self::on_gpus(comms, load, cfg, gpus, Device::Cuda, timeout)
    }

    /// [`nccl`](Self::nccl) on ROCm devices over RCCL (rank `i` on `rocm:gpus[i]`). Never run:
    /// no AMD GPU here.
    pub fn rccl(
        model: &ModelConfig,
        load: Arc<ModelLoader>,
        cfg: EngineConfig,
        gpus: &[usize],
    ) -> Result<Self> {
        sp::heads_per_card(model.num_heads, gpus.len())?;
        let comms = RcclComm::group(gpus, COLLECTIVE_TIMEOUT)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        Self::on_gpus(comms, load, cfg, gpus, Device::Rocm, COLLECTIVE_TIMEOUT)
    }

    /// The rank group over GPU communicators: rank `i` loads its model onto `device(gpus[i])`.
    fn on_gpus(
        comms: Vec<Arc<dyn Communicator>>,
        load: Arc<ModelLoader>,
        cfg: EngineConfig,
        gpus: &[usize],
        device: fn(usize) -> Device,
        timeout: Duration,
    ) -> Result<Self> {
        let gpus = gpus.to_vec();
        let group = RankGroup::spawn(comms, timeout, move |rank, comm| {
            let gpu = gpus
                .get(rank)
                .copied()
                .ok_or_else(|| Error::Config(format!("no GPU for rank {rank}")))?;
            let model = Arc::new(load(device(gpu))?);
            let engine = Engine::with_communicator(model, cfg.clone(), comm)?;
            Ok(RankEngine { engine, rank })
        })?;
        Ok(EngineGroup { group })
    }

    pub fn cards(&self) -> usize {
        self.group.world_size()
    }

    /// Generates the next chunk on every rank; rank 0's latents are returned.
    pub fn next_chunk(&mut self, inputs: &ChunkInputs) -> Result<Chunk> {
        self.group
            .run(Job::Chunk(inputs.clone()))?
            .ok_or_else(|| Error::Config("rank 0 returned no chunk".into()))
    }

    /// [`Engine::next_chunk_edit`] on every rank; rank 0's latents are returned.
    pub fn next_chunk_edit(&mut self, inputs: &ChunkInputs, edit: &Edit) -> Result<Chunk> {
        self.group
            .run(Job::Edit(inputs.clone(), edit.clone()))?
            .ok_or_else(|| Error::Config("rank 0 returned no chunk".into()))
    }

    /// [`Engine::set_prompt`] on every rank.
    pub fn set_prompt(&mut self, context: &Tensor) -> Result<()> {
        self.group.run(Job::Prompt(context.clone()))?;
        Ok(())
    }

    /// [`Engine::set_first_frame`] on every rank.
    pub fn set_first_frame(&mut self, latent: &Tensor) -> Result<()> {
        self.group.run(Job::FirstFrame(latent.clone()))?;
        Ok(())
    }

    /// [`Engine::reset`] on every rank.
    pub fn reset(&mut self) -> Result<()> {
        self.group.run(Job::Reset)?;
        Ok(())
    }

    /// [`Engine::set_resend_window`] on every rank.
    pub fn set_resend_window(&mut self, on: bool) -> Result<()> {
        self.group.run(Job::ResendWindow(on))?;
        Ok(())
    }

    /// Bytes each rank has sent so far, in rank order.
    pub fn comm_stats(&self) -> Vec<CommStats> {
        self.group
            .communicators()
            .iter()
            .map(|c| c.stats())
            .collect()
    }
}
