use crate::Result;

/// Where a tensor lives and which backend runs its ops.
///
/// A GPU variant whose backend cannot start here (no driver, no such device) is an error that
/// says why when first used.
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

    /// Waits for the work queued on this device (nothing to wait for on the CPU).
    pub fn synchronize(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(i) => crate::cuda::backend(i)?.synchronize(),
            Device::Rocm(i) => crate::rocm::backend(i)?.synchronize(),
        }
    }

    /// Fails, saying why, unless this backend can run ops on this machine.
    pub fn ensure_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(i) => crate::cuda::backend(i).map(|_| ()),
            Device::Rocm(i) => crate::rocm::backend(i).map(|_| ()),
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
