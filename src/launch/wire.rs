//! How a rank's result travels back to the launcher: a tiny self-describing-free binary encoding
//! (little-endian numbers, length-prefixed sequences) for the types a training function returns.

/// A value that can be sent from a rank to the launcher.
pub trait Wire: Sized {
    /// Append the encoding of `self`.
    fn encode(&self, out: &mut Vec<u8>);
    /// Decode from the front of `inp`, advancing it.
    fn decode(inp: &mut &[u8]) -> Option<Self>;
}

fn take<'a>(inp: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if inp.len() < n {
        return None;
    }
    let (a, b) = inp.split_at(n);
    *inp = b;
    Some(a)
}

macro_rules! wire_num {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn encode(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn decode(inp: &mut &[u8]) -> Option<Self> {
                Some(<$t>::from_le_bytes(take(inp, std::mem::size_of::<$t>())?.try_into().ok()?))
            }
        }
    )*};
}
wire_num!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, u128, i128);

impl Wire for usize {
    fn encode(&self, out: &mut Vec<u8>) {
        (*self as u64).encode(out)
    }
    fn decode(inp: &mut &[u8]) -> Option<Self> {
        u64::decode(inp).map(|v| v as usize)
    }
}

impl Wire for () {
    fn encode(&self, _: &mut Vec<u8>) {}
    fn decode(_: &mut &[u8]) -> Option<Self> {
        Some(())
    }
}

impl Wire for bool {
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(*self as u8)
    }
    fn decode(inp: &mut &[u8]) -> Option<Self> {
        Some(take(inp, 1)?[0] != 0)
    }
}

impl Wire for String {
    fn encode(&self, out: &mut Vec<u8>) {
        (self.len() as u64).encode(out);
        out.extend_from_slice(self.as_bytes());
    }
    fn decode(inp: &mut &[u8]) -> Option<Self> {
        let n = u64::decode(inp)? as usize;
        String::from_utf8(take(inp, n)?.to_vec()).ok()
    }
}

impl<T: Wire> Wire for Vec<T> {
    fn encode(&self, out: &mut Vec<u8>) {
        (self.len() as u64).encode(out);
        for x in self {
            x.encode(out);
        }
    }
    fn decode(inp: &mut &[u8]) -> Option<Self> {
        let n = u64::decode(inp)? as usize;
        let mut v = Vec::with_capacity(n.min(inp.len()));
        for _ in 0..n {
            v.push(T::decode(inp)?);
        }
        Some(v)
    }
}

impl<T: Wire> Wire for Option<T> {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            None => out.push(0),
            Some(x) => {
                out.push(1);
                x.encode(out)
            }
        }
    }
    fn decode(inp: &mut &[u8]) -> Option<Self> {
        match take(inp, 1)?[0] {
            0 => Some(None),
            _ => Some(Some(T::decode(inp)?)),
        }
    }
}

macro_rules! wire_tuple {
    ($($n:ident),*) => {
        impl<$($n: Wire),*> Wire for ($($n,)*) {
            #[allow(non_snake_case)]
            fn encode(&self, out: &mut Vec<u8>) {
                let ($($n,)*) = self;
                $($n.encode(out);)*
            }
            fn decode(inp: &mut &[u8]) -> Option<Self> {
                Some(($($n::decode(inp)?,)*))
            }
        }
    };
}
wire_tuple!(A, B);
wire_tuple!(A, B, C);
wire_tuple!(A, B, C, D);

/// Frame tags of a rank's outcome.
const TAG_OK: u8 = 0xA1;
const TAG_ERR: u8 = 0xA2;

/// Encode `Ok(value)` or `Err(message)` as one frame.
pub(crate) fn encode_outcome<R: Wire>(o: &Result<R, String>) -> Vec<u8> {
    let mut out = Vec::new();
    match o {
        Ok(v) => {
            out.push(TAG_OK);
            v.encode(&mut out);
        }
        Err(m) => {
            out.push(TAG_ERR);
            m.encode(&mut out);
        }
    }
    out
}

/// Decode a frame; `None` if the rank wrote nothing or something malformed.
pub(crate) fn decode_outcome<R: Wire>(mut b: &[u8]) -> Option<Result<R, String>> {
    let tag = *b.first()?;
    b = &b[1..];
    let r = match tag {
        TAG_OK => Ok(R::decode(&mut b)?),
        TAG_ERR => Err(String::decode(&mut b)?),
        _ => return None,
    };
    b.is_empty().then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let v: (u32, String, Vec<f32>) = (7, "hé".into(), vec![1.5, -2.0]);
        let b = encode_outcome(&Ok(v.clone()));
        assert_eq!(decode_outcome::<(u32, String, Vec<f32>)>(&b), Some(Ok(v)));
        let e = encode_outcome::<()>(&Err("boom".into()));
        assert_eq!(decode_outcome::<()>(&e), Some(Err("boom".into())));
        assert_eq!(decode_outcome::<u32>(&b[..3]), None);
    }
}
