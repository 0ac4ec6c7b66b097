//! Time a virtual machine's CPUs wanted to run but the hypervisor ran
//! something else (`steal` in /proc/stat). On a shared host the bench's
//! figures move with it, so the bench prints it beside them: a table
//! taken while the host was busy says so itself. (Not all of a busy
//! host's cost shows as steal: shared caches and memory bandwidth do not.)

/// The chosen CPUs' counters (/proc/stat ticks) at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTimes {
    cpus: Vec<usize>,
    /// Steal and all time, summed over `cpus`.
    steal: u64,
    total: u64,
}

impl CpuTimes {
    /// The counters of `cpus` now; `None` where /proc/stat cannot be read
    /// or lacks one of them (a kernel without steal accounting).
    #[must_use]
    pub fn now(cpus: &[usize]) -> Option<CpuTimes> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        parse(&stat, cpus)
    }

    /// The share of the time since `self` that was stolen, in percent,
    /// with the CPUs it covers: "CPU 0 lost 3.1% of its time to steal".
    #[must_use]
    pub fn report(&self, what: &str) -> String {
        let cpus = self
            .cpus
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" and ");
        let plural = if self.cpus.len() > 1 { "s" } else { "" };
        match CpuTimes::now(&self.cpus).and_then(|now| now.stolen_since(self)) {
            Some(pct) => format!(
                "CPU{plural} {cpus} lost {pct:.1}% of {} time to the hypervisor (steal, /proc/stat) while {what}",
                if plural.is_empty() { "its" } else { "their" },
            ),
            None => format!("CPU{plural} {cpus}: steal time unknown (/proc/stat)"),
        }
    }

    /// Percent of the time from `earlier` to `self` that was stolen.
    fn stolen_since(&self, earlier: &CpuTimes) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let steal = self.steal.checked_sub(earlier.steal)?;
        (total > 0).then(|| steal as f64 * 100.0 / total as f64)
    }
}

/// `cpus`' counters from /proc/stat's text: user nice system idle iowait
/// irq softirq steal (guest time is counted within user already).
fn parse(stat: &str, cpus: &[usize]) -> Option<CpuTimes> {
    let (mut steal, mut total) = (0, 0);
    for cpu in cpus {
        let name = format!("cpu{cpu}");
        let line = stat
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name.as_str()))?;
        let ticks: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|w| w.parse().ok())
            .collect::<Option<_>>()?;
        if ticks.len() < 8 {
            return None;
        }
        steal += ticks[7];
        total += ticks.iter().sum::<u64>();
    }
    Some(CpuTimes {
        cpus: cpus.to_vec(),
        steal,
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  10 0 10 70 0 0 0 10 0 0\n\
        cpu0 5 0 5 35 0 0 0 5 0 0\n\
        cpu1 5 0 5 35 0 0 0 5 0 0\n\
        intr 1 2 3\n";

    #[test]
    fn steal_is_a_share_of_all_the_cpus_time() {
        let before = parse(STAT, &[0]).unwrap();
        assert_eq!((before.steal, before.total), (5, 50));
        let after = parse(
            &STAT.replace("cpu0 5 0 5 35 0 0 0 5", "cpu0 5 0 5 115 0 0 0 25"),
            &[0],
        )
        .unwrap();
        assert_eq!(after.stolen_since(&before), Some(20.0));
        assert_eq!(parse(STAT, &[0, 1]).unwrap().total, 100);
    }

    #[test]
    fn a_missing_cpu_or_a_short_line_is_unknown() {
        assert_eq!(parse(STAT, &[2]), None);
        assert_eq!(parse("cpu0 1 2 3\n", &[0]), None);
    }
}
