use crate::{Error, Result};

/// Where a tensor lives and which backend runs its ops.
///
/// The GPU variants exist from the start so that call sites and tests are written against the
/// whole set; until their backends land, using one is an error that says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
    Rocm(usize),
}

impl Device {
    pub fn is_cpu(self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Fails, saying why, unless this backend can run ops on this machine.
    pub fn ensure_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(i) => crate::cuda::backend(i).map(|_| ()),
            Device::Rocm(_) => Err(Error::Device {
                device: self.to_string(),
                msg: format!(
                    "the ROCm op backend is not in this build yet (and has never run anywhere); \
                     use --device cpu or cuda. ROCm here: {}",
                    crate::rocm::status_line()
                ),
            }),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Rocm(i) => write!(f, "rocm:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (kind, index) = match s.split_once(':') {
            Some((k, i)) => {
                let i = i
                    .parse::<usize>()
                    .map_err(|_| format!("bad device index in '{s}'"))?;
                (k, i)
            }
            None => (s, 0),
        };
        match kind {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(index)),
            "rocm" | "hip" => Ok(Device::Rocm(index)),
            _ => Err(format!(
                "unknown device '{s}' (expected cpu, cuda[:N] or rocm[:N])"
            )),
        }
    }
}
