//! FashionMNIST (and MNIST) IDX files: reading with validation, gzip or raw.
//!
//! An IDX file is a 4-byte magic (`0, 0, type, ndims`; type 0x08 = unsigned byte), `ndims`
//! big-endian u32 dimensions, then the bytes. Every failure names the file and says what to do:
//! a wrong magic, a file shorter than its header promises, or image and label counts that differ.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Default dataset directory (Debian package `dataset-fashion-mnist`).
pub const DEFAULT_DATA_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Errors reading a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// Neither `NAME` nor `NAME.gz` exists in the data directory.
    #[error("{} not found (nor {}.gz); install the dataset with `apt-get install dataset-fashion-mnist` or pass --data DIR pointing at the IDX files", .path.display(), .path.display())]
    Missing {
        /// The path tried (without `.gz`).
        path: PathBuf,
    },
    /// Reading or decompressing failed.
    #[error("cannot read {}: {source}; check the file is a complete IDX (or gzipped IDX) file", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The magic number is not the expected one.
    #[error("{} is not an IDX file of the expected kind: magic {found:#010x}, expected {expected:#010x} (unsigned bytes, {dims} dimensions); is it the right file?", .path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// Magic found.
        found: u32,
        /// Magic expected.
        expected: u32,
        /// Dimensions expected.
        dims: usize,
    },
    /// The file ends before the data its header declares.
    #[error("{} is truncated: header declares {expected} bytes of data, file has {got}; re-download or reinstall the dataset", .path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header promises (header included).
        expected: usize,
        /// Bytes present.
        got: usize,
    },
    /// Image and label files disagree on the number of samples.
    #[error("{} has {images} images but {} has {labels} labels; the two files must come from the same split", .images_path.display(), .labels_path.display())]
    CountMismatch {
        /// Image file.
        images_path: PathBuf,
        /// Label file.
        labels_path: PathBuf,
        /// Images found.
        images: usize,
        /// Labels found.
        labels: usize,
    },
    /// A split holds no sample: training or evaluating on it would "succeed" without doing anything.
    #[error("{} holds no images; pass a directory with a non-empty {split} split (--data DIR)", .path.display())]
    Empty {
        /// The image file.
        path: PathBuf,
        /// `train` or `test`.
        split: &'static str,
    },
    /// The test images do not have the training images' shape.
    #[error("{} holds {got_rows}×{got_cols} images but the training split ({}) holds {rows}×{cols}; both splits must come from the same dataset", .path.display(), .train_path.display())]
    ShapeMismatch {
        /// The test image file.
        path: PathBuf,
        /// The training image file.
        train_path: PathBuf,
        /// Shape found in the test file.
        got_rows: usize,
        /// Shape found in the test file.
        got_cols: usize,
        /// Shape of the training images.
        rows: usize,
        /// Shape of the training images.
        cols: usize,
    },
    /// A label is not a class index.
    #[error("{} contains label {label} at index {index}; labels must be 0..=9", .path.display())]
    BadLabel {
        /// The file.
        path: PathBuf,
        /// The label.
        label: u8,
        /// Its position.
        index: usize,
    },
}

/// One split of an image-classification dataset, kept as bytes (pixels scaled when batched).
#[derive(Clone, Debug, Default)]
pub struct Dataset {
    /// Pixels, `[len, rows, cols]`, row-major.
    pub images: Vec<u8>,
    /// Class of every image.
    pub labels: Vec<u8>,
    /// Image height.
    pub rows: usize,
    /// Image width.
    pub cols: usize,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }
    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
    /// Pixels of sample `i`.
    pub fn image(&self, i: usize) -> &[u8] {
        let n = self.rows * self.cols;
        &self.images[i * n..(i + 1) * n]
    }
    /// Keep only the first `n` samples.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len() {
            self.labels.truncate(n);
            self.images.truncate(n * self.rows * self.cols);
        }
    }
}

/// Read the whole file, decompressing when it starts with the gzip magic.
fn read_bytes(path: &Path) -> Result<Vec<u8>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let raw = std::fs::read(path).map_err(io)?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(io)?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Read an unsigned-byte IDX file with `ndims` dimensions; returns the dimensions and the data.
pub fn read_idx(path: &Path, ndims: usize) -> Result<(Vec<usize>, Vec<u8>), DataError> {
    let mut bytes = read_bytes(path)?;
    let expected_magic = 0x0800 | ndims as u32;
    let header = 4 + 4 * ndims;
    if bytes.len() < 4 {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            expected: header,
            got: bytes.len(),
        });
    }
    let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if magic != expected_magic {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: expected_magic,
            dims: ndims,
        });
    }
    if bytes.len() < header {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            expected: header,
            got: bytes.len(),
        });
    }
    let dims: Vec<usize> = (0..ndims)
        .map(|i| {
            u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap_or([0; 4])) as usize
        })
        .collect();
    let n = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .unwrap_or(usize::MAX);
    let expected = header.saturating_add(n);
    if bytes.len() < expected {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            expected,
            got: bytes.len(),
        });
    }
    bytes.truncate(expected);
    bytes.drain(..header);
    Ok((dims, bytes))
}

/// `dir/name.gz` if present, else `dir/name`, else a [`DataError::Missing`].
fn find(dir: &Path, name: &str) -> Result<PathBuf, DataError> {
    let gz = dir.join(format!("{name}.gz"));
    if gz.exists() {
        return Ok(gz);
    }
    let raw = dir.join(name);
    if raw.exists() {
        return Ok(raw);
    }
    Err(DataError::Missing { path: raw })
}

/// Load an images/labels pair, checking that they agree.
pub fn load_pair(images_path: &Path, labels_path: &Path) -> Result<Dataset, DataError> {
    let (idims, images) = read_idx(images_path, 3)?;
    let (ldims, labels) = read_idx(labels_path, 1)?;
    if idims[0] != ldims[0] {
        return Err(DataError::CountMismatch {
            images_path: images_path.to_path_buf(),
            labels_path: labels_path.to_path_buf(),
            images: idims[0],
            labels: ldims[0],
        });
    }
    if let Some((index, &label)) = labels.iter().enumerate().find(|(_, &l)| l > 9) {
        return Err(DataError::BadLabel {
            path: labels_path.to_path_buf(),
            label,
            index,
        });
    }
    Ok(Dataset {
        images,
        labels,
        rows: idims[1],
        cols: idims[2],
    })
}

/// Load the training (`train = true`, `train-*`) or test (`t10k-*`) split from `dir`.
pub fn load_split(dir: &Path, train: bool) -> Result<Dataset, DataError> {
    load_split_at(dir, train).map(|(d, _)| d)
}

fn load_split_at(dir: &Path, train: bool) -> Result<(Dataset, PathBuf), DataError> {
    let prefix = if train { "train" } else { "t10k" };
    let images = find(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels = find(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let d = load_pair(&images, &labels)?;
    if d.is_empty() {
        return Err(DataError::Empty {
            path: images,
            split: if train { "train" } else { "test" },
        });
    }
    Ok((d, images))
}

/// Load both splits from `dir` and check that each holds samples and that they agree on the image
/// shape; an error names the file at fault.
pub fn load_splits(dir: &Path) -> Result<(Dataset, Dataset), DataError> {
    let (train, train_path) = load_split_at(dir, true)?;
    let (test, test_path) = load_split_at(dir, false)?;
    if (test.rows, test.cols) != (train.rows, train.cols) {
        return Err(DataError::ShapeMismatch {
            path: test_path,
            train_path,
            got_rows: test.rows,
            got_cols: test.cols,
            rows: train.rows,
            cols: train.cols,
        });
    }
    Ok((train, test))
}

/// Encode an unsigned-byte IDX file (used by tests and to make synthetic datasets).
pub fn encode_idx(dims: &[usize], data: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 0x08, dims.len() as u8];
    for &d in dims {
        v.extend_from_slice(&(d as u32).to_be_bytes());
    }
    v.extend_from_slice(data);
    v
}

/// Write a small synthetic, learnable 10-class dataset in IDX format into `dir` (train and test
/// splits), for tests on machines without the real dataset. Class `k` is a bright bar at a
/// class-specific position plus noise.
pub fn write_synthetic(
    dir: &Path,
    n_train: usize,
    n_test: usize,
    seed: u64,
) -> std::io::Result<()> {
    let mut rng = super::rng::Rng::new(seed, 77);
    for (prefix, n) in [("train", n_train), ("t10k", n_test)] {
        let mut images = vec![0u8; n * 784];
        let mut labels = vec![0u8; n];
        for i in 0..n {
            let k = rng.below(10) as usize;
            labels[i] = k as u8;
            let img = &mut images[i * 784..(i + 1) * 784];
            for px in img.iter_mut() {
                *px = (rng.below(60)) as u8;
            }
            let (r0, c0) = (2 + (k % 5) * 5, if k < 5 { 4 } else { 16 });
            for r in r0..r0 + 4 {
                for c in c0..c0 + 8 {
                    img[r * 28 + c] = 200 + rng.below(56) as u8;
                }
            }
        }
        std::fs::write(
            dir.join(format!("{prefix}-images-idx3-ubyte")),
            encode_idx(&[n, 28, 28], &images),
        )?;
        std::fs::write(
            dir.join(format!("{prefix}-labels-idx1-ubyte")),
            encode_idx(&[n], &labels),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, prefix: &str, n: usize, rows: usize, cols: usize) {
        std::fs::write(
            dir.join(format!("{prefix}-images-idx3-ubyte")),
            encode_idx(&[n, rows, cols], &vec![7u8; n * rows * cols]),
        )
        .unwrap();
        std::fs::write(
            dir.join(format!("{prefix}-labels-idx1-ubyte")),
            encode_idx(&[n], &vec![3u8; n]),
        )
        .unwrap();
    }

    #[test]
    fn empty_splits_and_shape_mismatch_name_the_file() {
        let dir = std::env::temp_dir().join(format!("lockstep-data-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // (train images, t10k images, t10k side, what the error must say)
        let cases: [(usize, usize, usize, &[&str]); 3] = [
            (
                0,
                5,
                28,
                &[
                    "train-images-idx3-ubyte holds no images",
                    "non-empty train split",
                ],
            ),
            (4, 0, 28, &["t10k-images-idx3-ubyte holds no images"]),
            (
                4,
                5,
                10,
                &[
                    "t10k-images-idx3-ubyte holds 10×10 images but the training split",
                    "holds 28×28",
                ],
            ),
        ];
        for (n_train, n_test, side, want) in cases {
            write(&dir, "train", n_train, 28, 28);
            write(&dir, "t10k", n_test, side, side);
            let e = load_splits(&dir).unwrap_err().to_string();
            for w in want {
                assert!(
                    e.contains(w),
                    "{n_train} / {n_test} images of side {side}: {e}"
                );
            }
        }
        write(&dir, "t10k", 5, 28, 28);
        let (train, test) = load_splits(&dir).unwrap();
        assert_eq!(
            (train.len(), test.len(), test.rows, test.cols),
            (4, 5, 28, 28)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
