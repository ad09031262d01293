//! Pinned plugins: a run config (or the `hearth.lock` beside it) may name
//! the sha256 of the exact component a user reviewed. A component whose
//! hash differs is refused before it is compiled, naming both hashes.

use super::PluginError;
use sha2::{Digest, Sha256};
use std::path::Path;

/// The sha256 of `bytes`, as 64 lower-case hex digits (what `sha256sum`
/// prints).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Checks a pin as written: 64 hex digits. Returns it in lower case.
pub fn parse_pin(text: &str) -> Result<String, String> {
    if text.len() == 64 && text.chars().all(|c| c.is_ascii_hexdigit()) {
        Ok(text.to_ascii_lowercase())
    } else {
        Err(format!(
            "{text:?} is not a sha256 (64 hex digits, as `sha256sum` or `hearth plugins list` prints it)"
        ))
    }
}

/// Refuses `bytes` (the component of plugin `name` at `path`) unless its
/// sha256 is `pin`.
pub fn check_pin(name: &str, path: &Path, pin: &str, bytes: &[u8]) -> Result<(), PluginError> {
    let actual = sha256_hex(bytes);
    if actual.eq_ignore_ascii_case(pin) {
        return Ok(());
    }
    Err(PluginError::Refused {
        name: name.into(),
        path: path.into(),
        reason: format!(
            "its sha256 is {actual}, but the run pins {}: it is not the component that was \
             pinned. If it was updated on purpose, review it and pin it anew (`hearth plugins \
             lock CONFIG`, or the config's sha256 key)",
            pin.to_ascii_lowercase()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_sha256sums() {
        // printf abc | sha256sum
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_pin_is_64_hex_digits_and_a_mismatch_names_both_hashes() {
        let good = sha256_hex(b"component");
        assert_eq!(parse_pin(&good.to_ascii_uppercase()).unwrap(), good);
        assert!(parse_pin("abc").is_err());
        assert!(parse_pin(&"g".repeat(64)).is_err());
        assert!(check_pin("p", Path::new("p.wasm"), &good, b"component").is_ok());
        let other = sha256_hex(b"another component");
        let e = check_pin("p", Path::new("p.wasm"), &good, b"another component")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&good) && e.contains(&other), "{e}");
    }
}
