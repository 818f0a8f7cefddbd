using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.Hosting;
using Npgsql;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>
/// What one processed message costs the database, read off the wire by <see cref="PgWireRecorder"/> (the relay the bench
/// profile uses, so it sees the store's raw commands and Npgsql's own BEGIN/SAVEPOINT/COMMIT, which EF Core interceptors
/// miss): EF Core's per-SaveChanges savepoint is off inside the inbox's transaction unless
/// <see cref="ExactlyOnceOptions.KeepSaveChangesSavepoints"/> asks for it, and batched mode keeps its own per-member one.
/// And what turning it off must not cost: a consumer that swallows a failed SaveChanges never commits half of it.
/// </summary>
public sealed class RoundTripTests : PostgresRabbitTest
{
    private const string EfSavepoint = "SAVEPOINT \"__EFSavePoint\"";
    private const string EfRelease = "RELEASE SAVEPOINT \"__EFSavePoint\"";

    [Fact]
    public async Task Consume_OneMessage_SendsNoSavepointAndNoSecondInboxWrite_AndWaitsForTheServerThreeTimes()
    {
        var wire = await RecordOneMessageAsync(batched: false, keepSavepoints: false);

        Assert.DoesNotContain(wire.Statements.Keys, s => s.Contains("SAVEPOINT", StringComparison.Ordinal));
        Assert.DoesNotContain(wire.Statements.Keys, s => s.StartsWith("UPDATE inbox_messages", StringComparison.Ordinal));
        // BEGIN rides in front of the claim (Npgsql writes it ahead of the next command), and the claim carries the
        // processed mark: three waits, four ReadyForQuery requests.
        Assert.Equal(
            ["BEGIN | set_config | INSERT INTO inbox_messages | SET LOCAL", "COMMIT", "INSERT INTO effects"],
            wire.RoundTrips);
        Assert.Equal(4, wire.SyncOrQueryMessages);
        // The claim's three statements run prepared: the server neither parses nor plans them again.
        Assert.Equal(3, wire.Prepared.Count(p => p.Key.Contains("inbox_messages", StringComparison.Ordinal) || p.Key.Contains("lock_timeout", StringComparison.Ordinal)));
        Assert.Contains(wire.Prepared.Keys, s => s.StartsWith("INSERT INTO inbox_messages", StringComparison.Ordinal));
    }

    [Fact]
    public async Task Consume_OneMessageWithPrepareStatementsOff_SendsTheClaimUnprepared()
    {
        var wire = await RecordOneMessageAsync(batched: false, keepSavepoints: false, prepare: false);

        Assert.Empty(wire.Prepared);
        Assert.Equal(
            ["BEGIN | set_config | INSERT INTO inbox_messages | SET LOCAL", "COMMIT", "INSERT INTO effects"],
            wire.RoundTrips);
    }

    [Fact]
    public async Task Consume_OneMessageWithKeepSaveChangesSavepoints_SendsEfCoresSavepointPair()
    {
        var wire = await RecordOneMessageAsync(batched: false, keepSavepoints: true);

        Assert.Equal(1, wire.Statements.GetValueOrDefault(EfSavepoint));
        Assert.Equal(1, wire.Statements.GetValueOrDefault(EfRelease));
        Assert.Equal(
            ["BEGIN | set_config | INSERT INTO inbox_messages | SET LOCAL", "COMMIT", "INSERT INTO effects", "RELEASE SAVEPOINT", "SAVEPOINT"],
            wire.RoundTrips);
        Assert.Equal(6, wire.SyncOrQueryMessages);
    }

    [Fact]
    public async Task Consume_OneMessageBatched_KeepsTheBatchsMemberSavepoint_AndSendsNoEfSavepoint()
    {
        var wire = await RecordOneMessageAsync(batched: true, keepSavepoints: false);

        Assert.Equal(1, wire.Statements.GetValueOrDefault("SAVEPOINT eo_member_0")); // what isolates a failing member
        Assert.DoesNotContain(wire.Statements.Keys, s => s.Contains("__EFSavePoint", StringComparison.Ordinal));
        Assert.Equal(
            ["BEGIN | set_config | INSERT INTO inbox_messages | SET LOCAL", "COMMIT", "SAVEPOINT | INSERT INTO effects"],
            wire.RoundTrips);
    }

    [Fact]
    public async Task Consume_OneMessageBatchedWithKeepSaveChangesSavepoints_SendsBothSavepoints()
    {
        var wire = await RecordOneMessageAsync(batched: true, keepSavepoints: true);

        Assert.Equal(1, wire.Statements.GetValueOrDefault("SAVEPOINT eo_member_0"));
        Assert.Equal(1, wire.Statements.GetValueOrDefault(EfSavepoint));
        Assert.Equal(1, wire.Statements.GetValueOrDefault(EfRelease));
    }

    /// <summary>
    /// The price of no savepoint, paid safely. The consumer's first SaveChanges inserts a row and updates one that does not
    /// exist: the update matches nothing, EF Core throws <see cref="DbUpdateConcurrencyException"/> — after the insert ran,
    /// and PostgreSQL's transaction is not aborted by it. The consumer swallows that and saves its effect. Without a
    /// savepoint the failed save's insert would commit along (two rows); the inbox must fail the attempt instead, and the
    /// retry (a fresh transaction) writes one. With <see cref="ExactlyOnceOptions.KeepSaveChangesSavepoints"/> EF Core
    /// undoes the failed save itself and the first attempt commits.
    /// </summary>
    [Theory]
    [InlineData(false, false)]
    [InlineData(false, true)]
    [InlineData(true, false)]
    [InlineData(true, true)]
    public async Task Consume_ConsumerSwallowsAFailedSaveChanges_NothingOfTheFailedSaveCommits(bool batched, bool keepSavepoints)
    {
        string queue = Queue("swallow");
        var counter = new DeliveryCounter();
        var id = NewId.NextGuid();
        Probe.BeforeSave = async (context, db) =>
        {
            if (Probe.Entries(id, nameof(EffectConsumer)) != 1)
            {
                return;
            }

            db.Effects.Add(new Effect { MessageId = id, Consumer = "half-saved" });
            db.Effects.Update(new Effect { Id = long.MaxValue, MessageId = id, Consumer = "missing" });
            try
            {
                await db.SaveChangesAsync();
            }
            catch (DbUpdateConcurrencyException)
            {
                db.ChangeTracker.Clear(); // "never mind", and carry on in the same transaction
            }
        };
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, e => e.UseMessageRetry(r => r.Immediate(3)), options: o =>
        {
            o.Batching.Enabled = batched;
            o.KeepSaveChangesSavepoints = keepSavepoints;
        });

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "the delivery handled");

        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.Equal(0, await CountEffectsAsync(id, "half-saved"));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
        Assert.Equal(keepSavepoints ? 1 : 2, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
    }

    /// <summary>Processes one message to warm up (connection opened, types loaded), then records exactly one more.</summary>
    private async Task<Wire> RecordOneMessageAsync(bool batched, bool keepSavepoints, bool prepare = true)
    {
        var server = new NpgsqlConnectionStringBuilder(TestHosts.PostgresServer);
        await using var recorder = new PgWireRecorder(server.Host ?? "127.0.0.1", server.Port);
        // Through the relay, unencrypted so that it can read it; no reset on close, so a pooled connection's reminder to
        // reset itself does not ride along with the next message's first command.
        string recorded = new NpgsqlConnectionStringBuilder(ConnectionString)
        {
            Host = "127.0.0.1", Port = recorder.Port, SslMode = SslMode.Disable, NoResetOnClose = true,
        }.ConnectionString;
        string queue = Queue("wire");
        var counter = new DeliveryCounter();
        IHost host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, options: o =>
        {
            o.Batching.Enabled = batched;
            o.KeepSaveChangesSavepoints = keepSavepoints;
            o.PrepareStatements = prepare;
        }, database: o => o.UseNpgsql(recorded));

        await SendAsync(host, queue, NewId.NextGuid());
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "the warm-up message handled");
        recorder.Reset();
        var id = NewId.NextGuid();
        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "the recorded message handled");

        // The COMMIT was read off the wire before the server answered it, so before the delivery could finish.
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.Equal(0, counter.Faulted);
        var roundTrips = recorder.RoundTripShapes
            .SelectMany(shape => Enumerable.Repeat(string.Join(" | ", shape.Key.Select(Label)), shape.Value))
            .Order(StringComparer.Ordinal)
            .ToList();
        return new Wire(recorder.Statements, roundTrips, recorder.SyncOrQueryMessages, recorder.PreparedExecutions.ToDictionary());
    }

    // A statement's first words, enough to tell the inbox's statements from the consumer's and Npgsql's own.
    private static string Label(string statement)
    {
        string[] words = statement.Split((char[]?)null, StringSplitOptions.RemoveEmptyEntries);
        return words[0] switch
        {
            "INSERT" => $"INSERT INTO {words[2]}",
            "UPDATE" => $"UPDATE {words[1]}",
            "RELEASE" or "SET" => $"{words[0]} {words[1]}",
            "SELECT" when statement.Contains("set_config", StringComparison.Ordinal) => "set_config",
            _ => words[0],
        };
    }

    private sealed record Wire(IReadOnlyDictionary<string, int> Statements, List<string> RoundTrips, int SyncOrQueryMessages, Dictionary<string, int> Prepared);
}
