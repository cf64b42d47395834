//! `--plot FILE`: training loss and test accuracy per epoch, side by side, as an SVG drawn with
//! plotters (feature `plot`, on by default; the collectives-only build never pulls it in). SVG
//! only: it needs no font files or image encoders, and every browser shows it.

use std::path::Path;

use lockstep_train::trainer::EpochReport;

/// Whether `path` names an SVG file (the only format written).
pub fn check_format(path: &Path) -> Result<(), String> {
    if !cfg!(feature = "plot") {
        return Err("--plot: this train-cnn was built without the `plot` feature; rebuild with default features".into());
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(()),
        _ => Err(format!(
            "--plot {}: plots are written as SVG; name the file with a .svg extension",
            path.display()
        )),
    }
}

/// Draw `history` into `path` (replaced atomically).
#[cfg(feature = "plot")]
pub fn write_svg(path: &Path, history: &[EpochReport]) -> Result<(), String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| format!("drawing the plot: {e}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 400)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (left, right) = root.split_horizontally(480);
        let last = history.iter().map(|r| r.epochs).max().unwrap_or(1).max(1);
        let xs = 0u64..last + 1;
        let labels = (last as usize + 2).min(12);
        let loss_top = history
            .iter()
            .map(|r| r.train_loss)
            .filter(|l| l.is_finite())
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.1;
        let acc_low = history.iter().map(|r| r.test_acc).fold(100.0f64, f64::min);
        let acc_low = (acc_low - 5.0).clamp(0.0, 95.0).floor();
        let series = [
            (
                &left,
                "training loss",
                "loss",
                0.0..loss_top,
                BLUE,
                history
                    .iter()
                    .map(|r| (r.epoch, r.train_loss))
                    .collect::<Vec<_>>(),
            ),
            (
                &right,
                "test accuracy",
                "accuracy (%)",
                acc_low..100.0,
                RED,
                history.iter().map(|r| (r.epoch, r.test_acc)).collect(),
            ),
        ];
        for (area, caption, y_desc, ys, color, points) in series {
            let mut c = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(55)
                .build_cartesian_2d(xs.clone(), ys)
                .map_err(|e| err(&e))?;
            c.configure_mesh()
                .x_desc("epoch")
                .y_desc(y_desc)
                .x_labels(labels)
                .draw()
                .map_err(|e| err(&e))?;
            c.draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?;
            c.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    lockstep::types::write_atomic(path, svg.as_bytes(), 0o644).map_err(|e| e.to_string())
}

/// Without the `plot` feature `--plot` is refused before training ([`check_format`]).
#[cfg(not(feature = "plot"))]
pub fn write_svg(_path: &Path, _history: &[EpochReport]) -> Result<(), String> {
    Err("this train-cnn was built without the `plot` feature".into())
}

#[cfg(all(test, feature = "plot"))]
mod tests {
    use super::*;

    #[test]
    fn svg_has_both_charts_and_the_points() {
        let r = |epoch, train_loss, test_acc| EpochReport {
            epoch,
            epochs: 3,
            train_loss,
            test_acc,
            test_count: 100,
            epoch_s: 1.0,
            images_per_s: 10.0,
            steps: 5,
            skipped_steps: 0,
            loss_scale: None,
        };
        let d = std::env::temp_dir().join(format!("lockstep-plot-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("curves.svg");
        write_svg(&p, &[r(1, 0.6, 80.0), r(2, 0.4, 86.5), r(3, 0.3, 88.0)]).unwrap();
        let s = std::fs::read_to_string(&p).unwrap();
        assert!(
            s.starts_with("<svg") && s.contains("training loss") && s.contains("test accuracy"),
            "{}",
            &s[..200.min(s.len())]
        );
        assert_eq!(
            s.matches("<circle").count(),
            6,
            "one marker per epoch and chart"
        );
        assert!(check_format(&p).is_ok());
        assert!(check_format(&d.join("curves.png"))
            .unwrap_err()
            .contains(".svg"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
