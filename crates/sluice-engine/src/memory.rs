//! How much memory this process may still take: the kernel's `MemAvailable`, capped by
//! the room its memory cgroup (a container's or a systemd slice's limit) leaves. The
//! `auto` choices (expert residency, the expert cache's default size, `--weights`)
//! depend on it, and a container's limit is invisible in `/proc/meminfo`.

use std::path::{Path, PathBuf};

/// Bytes that can be allocated without swapping or hitting a cgroup limit.
pub fn available() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| mem_available(&s));
    let cgroup =
        std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|s| cgroup_room(Path::new("/sys/fs/cgroup"), &s));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` from the text of `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// The least room under any memory limit on the way from this process's cgroup (named
/// in `proc_cgroup`, the text of `/proc/self/cgroup`) up to the root of the hierarchy
/// mounted at `root`: v2 (`0::/path`, `memory.max`) or v1 (`N:memory:/path` under
/// `root/memory`, `memory.limit_in_bytes`). `None` if no limit is set or readable.
fn cgroup_room(root: &Path, proc_cgroup: &str) -> Option<u64> {
    let mut least: Option<u64> = None;
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (mount, files) = if controllers.is_empty() {
            (root.to_path_buf(), V2)
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), V1)
        } else {
            continue;
        };
        // In a container the path may not exist under the mount (a namespaced view);
        // walking up still reaches the mount itself.
        let mut dir: PathBuf = mount.join(path.trim_start_matches('/'));
        loop {
            if let Some(r) = room_in(&dir, files) {
                least = Some(least.map_or(r, |l| l.min(r)));
            }
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
    }
    least
}

/// A cgroup version's file names: limit, usage, and the `memory.stat` key of the page
/// cache the kernel reclaims first (counted in usage, but not in the way).
type Files = (&'static str, &'static str, &'static str);
const V2: Files = ("memory.max", "memory.current", "inactive_file");
const V1: Files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file");

/// `limit - usage + inactive file pages` in one cgroup directory; `None` without a limit.
fn room_in(dir: &Path, (limit, usage, inactive): Files) -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let limit: u64 = read(limit)?.trim().parse().ok()?; // "max" (v2) does not parse: no limit
    if limit >= 1 << 60 {
        return None; // v1's "unlimited" is a number near 2^63
    }
    let usage: u64 = read(usage)?.trim().parse().ok()?;
    let stat = read("memory.stat").unwrap_or_default();
    let inactive = stat
        .lines()
        .find_map(|l| l.strip_prefix(inactive).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0u64);
    Some(limit.saturating_sub(usage) + inactive)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (f, text) in files {
            std::fs::write(dir.join(f), text).unwrap();
        }
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sluice-memory-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn meminfo() {
        let text = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   22000000 kB\n";
        assert_eq!(mem_available(text), Some(22_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn v2_limits_on_the_way_up() {
        let root = scratch("v2");
        // The slice above the process's cgroup has the tighter room.
        write(&root.join("user.slice"), &[("memory.max", "8000\n"), ("memory.current", "5000\n")]);
        write(
            &root.join("user.slice/app"),
            &[("memory.max", "max\n"), ("memory.current", "4000\n"), ("memory.stat", "anon 1\ninactive_file 500\n")],
        );
        assert_eq!(cgroup_room(&root, "0::/user.slice/app\n"), Some(3000));
        write(&root.join("user.slice/app"), &[("memory.max", "3000\n")]);
        // 3000 - 4000 saturates to 0, plus 500 of reclaimable page cache.
        assert_eq!(cgroup_room(&root, "0::/user.slice/app\n"), Some(500));
        // No limit anywhere, or nothing readable.
        assert_eq!(cgroup_room(&root, "0::/other\n"), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn v1_memory_controller_and_unlimited() {
        let root = scratch("v1");
        let unlimited = "9223372036854771712\n";
        write(&root.join("memory"), &[("memory.limit_in_bytes", unlimited), ("memory.usage_in_bytes", "7\n")]);
        write(
            &root.join("memory/jobs/42"),
            &[
                ("memory.limit_in_bytes", "5368709120\n"),
                ("memory.usage_in_bytes", "1073741824\n"),
                ("memory.stat", "cache 9\ninactive_file 1\ntotal_inactive_file 1024\n"),
            ],
        );
        let proc = "12:pids:/\n4:memory:/jobs/42\n0::/\n";
        assert_eq!(cgroup_room(&root, proc), Some(4 << 30 | 1024));
        // Only the unlimited root: no limit.
        assert_eq!(cgroup_room(&root, "4:memory:/\n"), None);
        // A namespaced path that does not exist under the mount: the mount's own limit.
        write(&root.join("memory"), &[("memory.limit_in_bytes", "100\n")]);
        assert_eq!(cgroup_room(&root, "4:memory:/not/here\n"), Some(93));
        let _ = std::fs::remove_dir_all(&root);
    }
}
