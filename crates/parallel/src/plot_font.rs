//! The font of every chart xtrain draws (loss curves, schedules, the planner's charts): DejaVu
//! Sans reduced to Latin-1, bundled (license and provenance in `assets/fonts/`) and registered
//! as plotters' `sans-serif`, so text renders the same on a bare machine without system fonts.
static FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");

/// Registers the bundled font as `sans-serif` (once per process; later calls only report).
pub fn register() -> Result<(), String> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, FONT)
            .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err("the bundled chart font does not parse".into())
    }
}
