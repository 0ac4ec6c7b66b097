//! The cluster's shared key, read from `cluster.key_file`: 32 or more
//! random bytes as hex, in a file only its owner may read (`huddle keygen`
//! makes one). Never printed.

use anyhow::{bail, Context, Result};
use std::{
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt},
    path::Path,
};

/// Bytes of key at least.
pub const MIN_KEY_BYTES: usize = 32;

/// The members' shared secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKey(Vec<u8>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey({} bytes)", self.0.len())
    }
}

impl ClusterKey {
    /// Reads the key at `path` (named by config field `field`), refusing
    /// a file others may read.
    pub fn load(path: &Path, field: &str) -> Result<ClusterKey> {
        let meta = std::fs::metadata(path)
            .with_context(|| format!("{field}: reading {}", path.display()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            bail!(
                "{field}: {} may be read by others (mode {mode:04o}): `chmod 600` it",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{field}: reading {}", path.display()))?;
        Self::from_hex(text.trim()).with_context(|| format!("{field}: {}", path.display()))
    }

    /// A 64-bit secret for `purpose`, the same from the same key on every
    /// balancer and unrelated to the key's other uses (an HMAC of the
    /// purpose's name).
    #[must_use]
    pub fn derive(&self, purpose: &str) -> u64 {
        use hmac::{Hmac, Mac};
        let mut m = Hmac::<sha2::Sha256>::new_from_slice(&self.0).expect("any key length");
        m.update(purpose.as_bytes());
        let out = m.finalize().into_bytes();
        u64::from_le_bytes(out[..8].try_into().expect("8 bytes")) | 1
    }

    /// A key from its hex text.
    pub fn from_hex(text: &str) -> Result<ClusterKey> {
        let Some(bytes) = unhex(text) else {
            bail!("not a key: hex digits expected (make one with `huddle keygen PATH`)");
        };
        if bytes.len() < MIN_KEY_BYTES {
            bail!(
                "a key of {} bytes; at least {MIN_KEY_BYTES} (make one with `huddle keygen PATH`)",
                bytes.len()
            );
        }
        Ok(ClusterKey(bytes))
    }

    /// The key's bytes, for the MACs.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// `b` as lowercase hex.
#[must_use]
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of hex text `s`; `None` if it is not hex.
#[must_use]
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// Writes a new random key to `path` (mode 0600; an existing file is left
/// alone): what `huddle keygen` does.
pub fn generate(path: &Path) -> Result<()> {
    use std::io::{Read, Write};
    // Read here, not through `sys::host::random_bytes`: config sits below
    // sys.
    let mut raw = [0u8; MIN_KEY_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .context("reading /dev/urandom")?;
    let text = hex(&raw);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {} (it must not exist yet)", path.display()))?;
    f.write_all(format!("{text}\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_long_hex_in_files_only_their_owner_reads() {
        let dir = std::env::temp_dir().join(format!("hc-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("cluster.key");
        generate(&p).unwrap();
        assert!(generate(&p).is_err(), "an existing key is never replaced");
        let k = ClusterKey::load(&p, "cluster.key_file").unwrap();
        assert_eq!(k.bytes().len(), MIN_KEY_BYTES);
        assert_eq!(format!("{k:?}"), "ClusterKey(32 bytes)");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = format!(
            "{:#}",
            ClusterKey::load(&p, "cluster.key_file").unwrap_err()
        );
        assert!(e.contains("may be read by others (mode 0644)"), "{e}");
        assert!(ClusterKey::from_hex("abcd").is_err());
        let other = ClusterKey::from_hex(&"ab".repeat(32)).unwrap();
        assert_eq!(k.derive("a"), k.derive("a"));
        assert_ne!(k.derive("a"), k.derive("b"));
        assert_ne!(k.derive("a"), other.derive("a"));
        assert!(ClusterKey::from_hex(&"zz".repeat(32)).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
