using ExactlyOnce;
using ExactlyOnce.Steps;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using ParcelTracker.Consumers;
using Xunit;
using Xunit.Abstractions;

namespace ParcelTracker.Tests;

/// <summary>
/// The carrier booking is a recorded step. The consumer process is killed with SIGKILL at each crash point — before
/// the call, after the carrier booked but before the step was recorded, after recording but before the commit, after
/// the commit but before the acknowledgement — once for each of 20 parcels, and restarted; then the bookings the
/// carrier holds are counted.
/// </summary>
public sealed class RecordedStepCrashTests(ITestOutputHelper output) : ParcelTrackerDatabaseTest
{
    private const int Parcels = 20;
    private const string Carrier = "parcel-tracker.carrier-assignment";

    public static TheoryData<string, string> Cases()
    {
        var cases = new TheoryData<string, string>();
        foreach (string point in new[] { "before-call", "after-call", "after-record", "after-commit" })
        {
            foreach (string carrier in new[] { "honours-keys/retry", "ignores-keys/reconcile", "ignores-keys/park" })
            {
                cases.Add(point, carrier);
            }
        }

        return cases;
    }

    [Theory]
    [MemberData(nameof(Cases))]
    public async Task CarrierBooking_ConsumerKilledAtACrashPointTwentyTimes_NeverBooksTwice_NeverLosesAMessage(string point, string carrier)
    {
        bool honours = carrier.StartsWith("honours", StringComparison.Ordinal);
        string policy = carrier.Split('/')[1];
        await using var rig = await CrashRig.StartAsync(Database,
            ["consumer", "--carrier-honours-keys", honours ? "true" : "false", "--carrier-when-unknown", policy, "--crash-at", point, "--crash-times", Parcels.ToString(System.Globalization.CultureInfo.InvariantCulture)],
            output);
        var parcels = await rig.SendParcelsAsync(Parcels, CarrierAssignmentConsumer.Queue);

        await rig.RunUntilAsync(async () =>
            rig.CrashesAt(point, CarrierAssignmentConsumer.Queue) == Parcels
            && await ProcessedAsync(rig) + await ParkedAsync(rig) == Parcels
            && await Services.ReadyMessagesAsync(CarrierAssignmentConsumer.Queue) == 0
            && await Services.ReadyMessagesAsync(CarrierAssignmentConsumer.Queue + "_parked") == await ParkedAsync(rig),
            "every parcel booked or parked after 20 crashes", TimeSpan.FromMinutes(3));

        long processed = await ProcessedAsync(rig);
        long parked = await ParkedAsync(rig);
        long bookings = await rig.ScalarAsync("SELECT count(*) FROM carrier_reservations");
        long calls = await rig.ScalarAsync("SELECT COALESCE(sum(calls), 0) FROM carrier_reservations");
        long maxPerParcel = await rig.ScalarAsync("SELECT COALESCE(max(n), 0) FROM (SELECT count(*) n FROM carrier_reservations GROUP BY parcel_id) b");
        long slots = await rig.ScalarAsync("SELECT count(*) FROM parcels WHERE pickup_slot IS NOT NULL");
        uint parkedQueue = await Services.ReadyMessagesAsync(CarrierAssignmentConsumer.Queue + "_parked");
        output.WriteLine($"{point}, carrier {carrier}: {rig.CrashesAt(point, CarrierAssignmentConsumer.Queue)} crashes at the point, {rig.ExitCodes.Count} kills " +
                         $"(exit codes {string.Join(",", rig.ExitCodes.Distinct())}); processed {processed}, parked {parked} ({parkedQueue} in the parked queue); " +
                         $"carrier bookings {bookings} ({calls} calls, at most {maxPerParcel} per parcel); slots stored {slots}");

        Assert.Equal(Parcels, rig.CrashesAt(point, CarrierAssignmentConsumer.Queue));
        Assert.NotEmpty(rig.ExitCodes);
        Assert.All(rig.ExitCodes, code => Assert.Equal(137, code)); // SIGKILL, nothing else
        Assert.Equal(Parcels, processed + parked); // nothing lost, nothing acknowledged away
        Assert.True(maxPerParcel <= 1, $"a parcel was booked {maxPerParcel} times");
        Assert.Equal(processed, slots);
        Assert.Equal(parked, (long)parkedQueue);

        // Deliveries killed at the point, and (caught by the same kill elsewhere on their way) any others.
        var crashedAtPoint = rig.CrashedMessages(point, CarrierAssignmentConsumer.Queue);
        bool unknownOutcome = point is "before-call" or "after-call";
        if (policy == "park")
        {
            // An unknown outcome parks the message, with its reason, listed for an operator; a known one never does.
            var listed = await ParkedStepsAsync(rig);
            Assert.Equal(parked, listed.Count);
            Assert.All(listed, s => Assert.Contains("whether the remote service acted is unknown", s.Reason, StringComparison.Ordinal));
            var parkedIds = listed.Select(s => s.Key.Message.MessageId).ToHashSet();
            if (unknownOutcome)
            {
                Assert.Equal(Parcels, parked);
                Assert.Subset(parkedIds, crashedAtPoint);
            }
            else
            {
                Assert.Empty(parkedIds.Intersect(crashedAtPoint));
            }

            Assert.Equal(Parcels - parked, bookings - await rig.ScalarAsync(
                $"SELECT count(*) FROM carrier_reservations r JOIN parcels p ON p.id = r.parcel_id WHERE p.pickup_slot IS NULL"));
        }
        else
        {
            // Exactly one booking per parcel.
            Assert.Equal(0, parked);
            Assert.Equal(Parcels, processed);
            Assert.Equal(Parcels, bookings);
            Assert.Equal(Parcels, await rig.ScalarAsync("SELECT count(DISTINCT parcel_id) FROM carrier_reservations"));
            if (honours)
            {
                // The key-honouring carrier saw a repeated call (same key, deduplicated) wherever the outcome was unknown.
                Assert.True(calls >= (point == "after-call" ? 2 * Parcels : Parcels), $"{calls} calls");
            }
            else
            {
                // Reconciliation found the bookings that were made and never called again.
                Assert.Equal(Parcels, calls);
            }
        }

        // Each booking carries the step's derived key.
        foreach (var (parcelId, messageId) in parcels)
        {
            long withKey = await rig.ScalarAsync(
                $"SELECT count(*) FROM carrier_reservations WHERE parcel_id = '{parcelId}' AND idempotency_key = '{IdempotencyKeys.ForStep(new InboxKey(messageId, Carrier), CarrierAssignmentConsumer.ReserveStep)}'");
            long any = await rig.ScalarAsync($"SELECT count(*) FROM carrier_reservations WHERE parcel_id = '{parcelId}'");
            Assert.Equal(any, withKey);
        }
    }

    /// <summary>
    /// The hardest point with one process per crash: 20 separate SIGKILLs, one delivery at a time, each the moment its
    /// booking reached the key-ignoring carrier and before the step was recorded.
    /// </summary>
    [Fact]
    public async Task CarrierBooking_TwentySeparateKillsAfterTheCarrierBooked_ReconcileBooksOncePerParcel()
    {
        await using var rig = await CrashRig.StartAsync(Database,
            ["consumer", "--carrier-honours-keys", "false", "--carrier-when-unknown", "reconcile", "--crash-at", "after-call", "--crash-times", "20", "--crash-gather-ms", "0", "--consumer-concurrency", "1"],
            output);
        await rig.SendParcelsAsync(Parcels, CarrierAssignmentConsumer.Queue);
        await rig.RunUntilAsync(async () => rig.CrashesAt("after-call", CarrierAssignmentConsumer.Queue) == Parcels && await ProcessedAsync(rig) == Parcels,
            "every parcel booked after 20 kills", TimeSpan.FromMinutes(4));

        long bookings = await rig.ScalarAsync("SELECT count(*) FROM carrier_reservations");
        output.WriteLine($"{rig.ExitCodes.Count} kills (exit codes {string.Join(",", rig.ExitCodes.Distinct())}); carrier bookings {bookings}, " +
                         $"calls {await rig.ScalarAsync("SELECT sum(calls) FROM carrier_reservations")}");
        Assert.Equal(Parcels, rig.ExitCodes.Count); // one kill per delivery
        Assert.All(rig.ExitCodes, code => Assert.Equal(137, code));
        Assert.Equal(Parcels, bookings);
        Assert.Equal(Parcels, await rig.ScalarAsync("SELECT count(DISTINCT parcel_id) FROM carrier_reservations"));
    }

    /// <summary>The teeth of the tests above: a carrier that ignores keys, told to retry with the same key, books twice.</summary>
    [Fact]
    public async Task CarrierBooking_KeyIgnoringCarrierWithRetryPolicy_KilledAfterTheCall_BooksTwice_AsTheTestsWouldSee()
    {
        await using var rig = await CrashRig.StartAsync(Database,
            ["consumer", "--carrier-honours-keys", "false", "--carrier-when-unknown", "retry", "--crash-at", "after-call", "--crash-times", "10"], output);
        await rig.SendParcelsAsync(10, CarrierAssignmentConsumer.Queue);
        await rig.RunUntilAsync(async () => rig.CrashesAt("after-call", CarrierAssignmentConsumer.Queue) == 10 && await ProcessedAsync(rig) == 10,
            "every parcel booked", TimeSpan.FromMinutes(2));

        Assert.Equal(20, await rig.ScalarAsync("SELECT count(*) FROM carrier_reservations"));
        Assert.Equal(2, await rig.ScalarAsync("SELECT min(n) FROM (SELECT count(*) n FROM carrier_reservations GROUP BY parcel_id) b"));
    }

    private static Task<long> ProcessedAsync(CrashRig rig) =>
        rig.ScalarAsync($"SELECT count(*) FROM inbox_messages WHERE consumer_type = '{Carrier}' AND processed_at IS NOT NULL");

    private static Task<long> ParkedAsync(CrashRig rig) =>
        rig.ScalarAsync($"SELECT count(*) FROM recorded_steps WHERE status = '{nameof(StepStatus.Parked)}'");

    private static async Task<IReadOnlyList<StepRecord>> ParkedStepsAsync(CrashRig rig)
    {
        var services = new ServiceCollection();
        services.AddLogging();
        services.AddDbContext<Data.ParcelDbContext>(o => o.UseNpgsql(rig.Database));
        services.AddExactlyOnce<Data.ParcelDbContext>();
        await using var provider = services.BuildServiceProvider();
        return await provider.GetRequiredService<IRecordedStepAdministration>().ListParkedAsync(1000);
    }
}
