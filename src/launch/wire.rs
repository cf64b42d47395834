//! How a rank's result travels back to the launcher: `Ok(value)` or `Err(message)`, serialized
//! with serde (bincode's compact varint encoding), so any `Serialize + DeserializeOwned` type can
//! be a rank's result with no trait of ours to implement.

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A rank's result is bounded: a frame larger than this is refused rather than allocated.
const MAX_FRAME: u64 = 1 << 30;

fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_limit(MAX_FRAME)
        .reject_trailing_bytes()
}

/// Encode `Ok(value)` or `Err(message)` as one frame. A value that cannot be serialized (a map
/// with non-string keys is fine, but e.g. a serializer error from a custom impl) becomes an error
/// frame that says so, so the launcher still reports the rank.
pub(crate) fn encode_outcome<R: Serialize>(o: &Result<R, String>) -> Vec<u8> {
    options().serialize(o).unwrap_or_else(|e| {
        let msg: Result<(), String> =
            Err(format!("the rank's result could not be serialized: {e}"));
        options().serialize(&msg).unwrap_or_default()
    })
}

/// Decode a frame; `None` if the rank wrote nothing or something malformed.
pub(crate) fn decode_outcome<R: DeserializeOwned>(b: &[u8]) -> Option<Result<R, String>> {
    options().deserialize(b).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let v: (u32, String, Vec<f32>) = (7, "hé".into(), vec![1.5, -2.0, f32::NAN]);
        let b = encode_outcome(&Ok(v.clone()));
        let back = decode_outcome::<(u32, String, Vec<f32>)>(&b)
            .unwrap()
            .unwrap();
        assert_eq!((back.0, &back.1, &back.2[..2]), (7, &v.1, &v.2[..2]));
        assert!(back.2[2].is_nan());
        let e = encode_outcome::<()>(&Err("boom".into()));
        assert_eq!(decode_outcome::<()>(&e), Some(Err("boom".into())));
        assert_eq!(decode_outcome::<(u32, String, Vec<f32>)>(&b[..3]), None);
        let mut long = b.clone();
        long.push(0);
        assert_eq!(
            decode_outcome::<(u32, String, Vec<f32>)>(&long),
            None,
            "trailing bytes are refused"
        );
    }
}
