//! How a rank's result travels back to the launcher: `Ok(value)` or `Err(message)`, serialized
//! with serde in postcard's compact varint format, so any `Serialize + DeserializeOwned` type can
//! be a rank's result with no trait of ours to implement.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// A rank's result is bounded: a frame larger than this is refused rather than decoded.
const MAX_FRAME: usize = 1 << 30;

/// Encode `Ok(value)` or `Err(message)` as one frame. A value that cannot be serialized (a map
/// with non-string keys is fine, but e.g. a serializer error from a custom impl) becomes an error
/// frame that says so, so the launcher still reports the rank.
pub(crate) fn encode_outcome<R: Serialize>(o: &Result<R, String>) -> Vec<u8> {
    let err = |e: String| {
        let msg: Result<(), String> = Err(e);
        postcard::to_allocvec(&msg).unwrap_or_default()
    };
    match postcard::to_allocvec(o) {
        Ok(b) if b.len() <= MAX_FRAME => b,
        Ok(b) => err(format!(
            "the rank's result is {} bytes serialized, more than the {MAX_FRAME}-byte limit: return a summary and write bulk data to a file",
            b.len()
        )),
        Err(e) => err(format!("the rank's result could not be serialized: {e}")),
    }
}

/// Decode a frame; `None` if the rank wrote nothing, something malformed, or bytes after the
/// value (a frame is exactly one value).
pub(crate) fn decode_outcome<R: DeserializeOwned>(b: &[u8]) -> Option<Result<R, String>> {
    if b.len() > MAX_FRAME {
        return None;
    }
    match postcard::take_from_bytes(b) {
        Ok((v, [])) => Some(v),
        _ => None,
    }
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
