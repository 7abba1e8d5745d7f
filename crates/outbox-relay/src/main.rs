#[tokio::main]
async fn main() -> anyhow::Result<()> {
    outbox_relay::cli::main().await
}
