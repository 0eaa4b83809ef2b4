//! The storage tiers a rank's blocks live in, and which event `medium` names which tier
//! (`docs.md`, "Storage tiers"). It owns that mapping and nothing else: no event, no lock.

/// Where a rank holds a block, nearest the GPU first: the order an engine loads a prefix in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tier {
    #[default]
    Gpu = 0,
    Cpu = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Disk];

    /// The tier an event's `medium` names (case-insensitively): none or `GPU` is GPU; `CPU`
    /// (vLLM's offloading, LMCache) and `CPU_PINNED` (SGLang's HiCache) are CPU; `STORAGE`,
    /// `DISK`, `EXTERNAL` (SGLang) and `FS`, `OBJ` (older vLLM) are disk. `None` for any other:
    /// such events are counted, not indexed.
    pub fn of_medium(medium: Option<&str>) -> Option<Tier> {
        let Some(medium) = medium else {
            return Some(Tier::Gpu);
        };
        let is = |name: &str| medium.eq_ignore_ascii_case(name);
        if is("GPU") {
            Some(Tier::Gpu)
        } else if is("CPU") || is("CPU_PINNED") {
            Some(Tier::Cpu)
        } else if ["STORAGE", "DISK", "FS", "OBJ", "EXTERNAL"]
            .iter()
            .any(|n| is(n))
        {
            Some(Tier::Disk)
        } else {
            None
        }
    }
}

/// One value per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerTier<T> {
    pub gpu: T,
    pub cpu: T,
    pub disk: T,
}

impl<T: Copy> PerTier<T> {
    pub fn all(value: T) -> PerTier<T> {
        PerTier {
            gpu: value,
            cpu: value,
            disk: value,
        }
    }

    pub fn get(&self, tier: Tier) -> T {
        match tier {
            Tier::Gpu => self.gpu,
            Tier::Cpu => self.cpu,
            Tier::Disk => self.disk,
        }
    }

    pub fn set(&mut self, tier: Tier, value: T) {
        match tier {
            Tier::Gpu => self.gpu = value,
            Tier::Cpu => self.cpu = value,
            Tier::Disk => self.disk = value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Tier;

    #[test]
    fn every_documented_medium_names_its_tier() {
        let cases = [
            (None, Some(Tier::Gpu)),
            (Some("GPU"), Some(Tier::Gpu)),
            (Some("cpu"), Some(Tier::Cpu)),
            (Some("CPU_PINNED"), Some(Tier::Cpu)),
            (Some("STORAGE"), Some(Tier::Disk)),
            (Some("DISK"), Some(Tier::Disk)),
            (Some("FS"), Some(Tier::Disk)),
            (Some("OBJ"), Some(Tier::Disk)),
            (Some("EXTERNAL"), Some(Tier::Disk)),
            (Some("NVME-OF"), None),
            (Some(""), None),
        ];
        for (medium, tier) in cases {
            assert_eq!(Tier::of_medium(medium), tier, "{medium:?}");
        }
    }
}
