//! Resident memory and CPU time of a process on this machine, from `/proc`.

/// Clock ticks per second in `/proc/*/stat`: `USER_HZ`, which Linux fixes at 100 for user space
/// on every mainstream architecture (reading `sysconf` would need `unsafe`, denied here).
pub const TICKS_PER_S: f64 = 100.0;

/// Resident set size of `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// User plus system CPU time of `pid` (this process when `None`), in clock ticks.
pub fn cpu_ticks(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".to_owned(),
    };
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    // After the name, field 3 (state) is index 0, so utime (14) and stime (15) are 11 and 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_figures() {
        let pid = std::process::id();
        assert!(rss_bytes(pid).unwrap() > 0);
        assert!(cpu_ticks(None).is_some());
        assert!(cpu_ticks(Some(pid)).is_some());
    }
}
