//! Small files that must survive a crash whole (the bridge's ledger, the replica id).

use std::io::Write;
use std::path::Path;

/// Temp file, fsync, rename over, fsync the directory: after a crash the file is either the
/// old or the new version, never a torn one. Creates the directory if missing.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}
